//! An element as the checksum reads it: its bits as one or two 32-bit
//! words, mixed with its position into the hash, and its value in the
//! precision its sums run in. `checksum.cu` has the same functions for the
//! device, operation for operation.

/// Golden-ratio increment: position `p`'s key is `p * PHI mod 2^32`, its
/// weight the key's top 24 bits over 2^24.
pub(crate) const PHI: u32 = 0x9E37_79B9;

/// The key of position `p` (the position cut to 32 bits, as the kernel
/// does).
#[inline(always)]
pub(crate) fn key(p: usize) -> u32 {
    (p as u32).wrapping_mul(PHI)
}

/// murmur3's 32-bit finalizer: a bijection that spreads every input bit.
#[inline(always)]
fn fmix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    x = x.wrapping_mul(0xc2b2_ae35);
    x ^ (x >> 16)
}

/// The precision a span of elements is summed in: `f32` for elements of
/// up to 32 bits, `f64` for wider ones.
pub(crate) trait Acc:
    Copy + Default + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> + Send
{
    fn abs(self) -> Self;
    /// The weight of a position's key: its top 24 bits over 2^24 (exact).
    fn weight(key: u32) -> Self;
    fn to_f64(self) -> f64;
}

impl Acc for f32 {
    #[inline(always)]
    fn abs(self) -> Self {
        f32::abs(self)
    }
    #[inline(always)]
    fn weight(key: u32) -> Self {
        (key >> 8) as f32 * (1.0 / 16_777_216.0)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Acc for f64 {
    #[inline(always)]
    fn abs(self) -> Self {
        f64::abs(self)
    }
    #[inline(always)]
    fn weight(key: u32) -> Self {
        f64::from(key >> 8) * (1.0 / 16_777_216.0)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
}

/// An element: its 32-bit words (one or two) and its value.
pub(crate) trait Element: Copy + Send + Sync + Default {
    type Acc: Acc;
    /// The element's bits, as one or two words.
    fn words(self) -> (u32, Option<u32>);
    fn value(self) -> Self::Acc;
}

macro_rules! element_32 {
    ($($t:ty => |$v:ident| ($bits:expr, $value:expr)),* $(,)?) => {$(
        impl Element for $t {
            type Acc = f32;
            #[inline(always)]
            fn words(self) -> (u32, Option<u32>) {
                let $v = self;
                ($bits, None)
            }
            #[inline(always)]
            fn value(self) -> f32 {
                let $v = self;
                $value
            }
        }
    )*};
}
element_32!(
    u8 => |v| (u32::from(v), f32::from(v)),
    u32 => |v| (v, v as f32),
    i16 => |v| (u32::from(v as u16), f32::from(v)),
    i32 => |v| (v as u32, v as f32),
    f32 => |v| (v.to_bits(), v),
    half::f16 => |v| (u32::from(v.to_bits()), v.to_f32()),
    half::bf16 => |v| (u32::from(v.to_bits()), v.to_f32()),
);

impl Element for f64 {
    type Acc = f64;
    #[inline(always)]
    fn words(self) -> (u32, Option<u32>) {
        let b = self.to_bits();
        (b as u32, Some((b >> 32) as u32))
    }
    #[inline(always)]
    fn value(self) -> f64 {
        self
    }
}

impl Element for i64 {
    type Acc = f64;
    #[inline(always)]
    fn words(self) -> (u32, Option<u32>) {
        let b = self as u64;
        (b as u32, Some((b >> 32) as u32))
    }
    #[inline(always)]
    fn value(self) -> f64 {
        self as f64
    }
}

/// The two hash terms of an element whose position's key is `key`: a
/// bijection of its first word (so that any change of one element changes
/// the first term), and that term times an odd number set by the position.
#[inline(always)]
pub(crate) fn mix<T: Element>(x: T, key: u32) -> (u32, u32) {
    let (lo, hi) = x.words();
    let a = fmix(lo ^ key);
    let mut h0 = a;
    let mut h1 = a.wrapping_mul(key | 1);
    if let Some(hi) = hi {
        let b = fmix(hi ^ key.rotate_left(16));
        h0 = h0.wrapping_add(b.rotate_left(11));
        h1 = h1.wrapping_add(b.wrapping_mul(key.rotate_left(16) | 1));
    }
    (h0, h1)
}
