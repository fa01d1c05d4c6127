//! A set of a statement's (or a region's) positions in one `u64`: which of
//! its outputs needed gradients in the forward, which of a region's outputs
//! are constants, which of the values a statement read were strided views.

/// Positions `0..Mask::CAPACITY` of a statement's outputs or inputs, one
/// bit each. Past the capacity a mask holds nothing: [`Mask::get`] says
/// `None` there, and each use states its own conservative answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Mask(u64);

impl Mask {
    /// The positions a mask holds.
    pub const CAPACITY: usize = u64::BITS as usize;

    /// Every position.
    pub const ALL: Mask = Mask(u64::MAX);

    /// The positions `i < n` (up to the capacity) at which `f(i)` holds.
    pub fn of(n: usize, mut f: impl FnMut(usize) -> bool) -> Mask {
        Mask(
            (0..n.min(Self::CAPACITY))
                .filter(|&i| f(i))
                .fold(0, |m, i| m | 1 << i),
        )
    }

    /// The positions at which `bits` yields `true` (up to the capacity).
    pub fn from_bits(bits: impl IntoIterator<Item = bool>) -> Mask {
        Mask(
            bits.into_iter()
                .take(Self::CAPACITY)
                .enumerate()
                .filter(|&(_, b)| b)
                .fold(0, |m, (i, _)| m | 1 << i),
        )
    }

    /// Whether position `i` is in the set; `None` past the capacity.
    pub fn get(self, i: usize) -> Option<bool> {
        (i < Self::CAPACITY).then(|| self.0 & (1 << i) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::Mask;

    #[test]
    fn holds_the_first_sixty_four_positions_and_says_none_past_them() {
        let m = Mask::of(100, |i| i % 3 == 0);
        assert_eq!(m.get(0), Some(true));
        assert_eq!(m.get(1), Some(false));
        assert_eq!(m.get(63), Some(true));
        assert_eq!(m.get(64), None);
        assert_eq!(m.get(99), None);
        assert_eq!(Mask::of(2, |_| true), Mask::of(64, |i| i < 2));
        assert_eq!(Mask::from_bits((0..100).map(|i| i % 3 == 0)), m);
        assert_eq!(Mask::ALL.get(63), Some(true));
        assert_eq!(Mask::default().get(5), Some(false));
    }
}
