//! Leaves read in the forward's layout. Where the forward read a value as
//! a strided view (a transpose, a chunk of a packed projection), the
//! statements of a replay read its leaf through a view with the forward's
//! strides, so that candle's kernels visit the elements in the forward's
//! order and a replay on the CPU gives the forward's bits: a sum over a
//! transposed view and over a contiguous copy add in different orders, and
//! over cancelling values they differ by far more than the output's own
//! rounding.
//!
//! The leaf holds the value's elements in memory order (outermost stride
//! first), with zeros in the gaps between them: a transpose's leaf is as
//! large as the value and read through views at no cost; a chunk's spans
//! the chunks beside it.

use candle_core::{Device, Layout, Tensor};

use super::make_leaf;
use crate::Result;

/// How a value is laid out in the forward, and how a leaf reproduces it.
#[derive(Debug, Clone)]
pub(crate) struct Relayout {
    dims: Vec<usize>,
    strides: Vec<usize>,
    /// The dims that address memory (stride above 0), outermost first.
    chain: Vec<usize>,
}

/// Whether leaves on `device` are read in the forward's layout: on the CPU,
/// and elsewhere with `REMAT_REPLAY_VIEWS=1` (on other devices the replay
/// is compared within the tolerance whatever the layouts, and this path has
/// not run on a GPU yet).
fn enabled(device: &Device) -> bool {
    device.is_cpu() || std::env::var_os("REMAT_REPLAY_VIEWS").is_some_and(|v| v == "1")
}

impl Relayout {
    /// The relayout of a value laid out as `layout` on `device`; `None`
    /// where a contiguous leaf serves (a contiguous or empty value), or no
    /// view of a leaf can have its strides (overlapping elements, strides
    /// that do not nest): the replay then compares that statement within
    /// the dtype's tolerance.
    pub fn of(layout: &Layout, device: &Device) -> Option<Self> {
        let (dims, strides) = (layout.dims(), layout.stride());
        if !enabled(device) || layout.is_contiguous() || layout.shape().elem_count() == 0 {
            return None;
        }
        let rank = dims.len();
        let mut chain: Vec<usize> = (0..rank).filter(|&i| strides[i] > 0).collect();
        chain.sort_by(|&a, &b| strides[b].cmp(&strides[a]).then(dims[b].cmp(&dims[a])));
        let nested = chain.windows(2).all(|pair| {
            let (outer, inner) = (strides[pair[0]], strides[pair[1]]);
            outer % inner == 0 && outer / inner >= dims[pair[1]]
        });
        // A size-1 dim of stride 0 can be made only ahead of every other.
        let leading = (0..rank).take_while(|i| !chain.contains(i)).count();
        let zero_inside = (leading..rank).any(|i| strides[i] == 0 && dims[i] == 1);
        (!chain.is_empty() && nested && !zero_inside).then(|| Relayout {
            dims: dims.to_vec(),
            strides: strides.to_vec(),
            chain,
        })
    }

    /// A leaf standing for `t` (a value laid out as this relayout says, or
    /// a contiguous copy of one): its elements in memory order, padded.
    pub fn leaf(&self, t: &Tensor) -> Result<Tensor> {
        make_leaf(&self.pack(&t.detach())?)
    }

    /// What statements read in place of the value: `leaf` seen through a
    /// view with the forward's dims and strides (no copy).
    pub fn read(&self, leaf: &Tensor) -> Result<Tensor> {
        let view = self.unpack(leaf, true)?;
        Ok(view.broadcast_as(self.dims.as_slice())?)
    }

    /// The value's gradient from its leaf's, detached: a view of it with the
    /// forward's strides (no copy), except that a broadcast dim gets the
    /// whole sum at its first element and zeros elsewhere (a copy; its
    /// producer's broadcast adds them up anyway).
    pub fn grad(&self, g: &Tensor) -> Result<Tensor> {
        let mut view = self.unpack(&g.detach(), false)?;
        for i in 0..self.dims.len() {
            if self.strides[i] == 0 && self.dims[i] > 1 {
                view = view.pad_with_zeros(i, 0, self.dims[i] - 1)?;
            }
        }
        Ok(view)
    }

    /// The dims outside the chain, in order.
    fn outside(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.dims.len()).filter(|i| !self.chain.contains(i))
    }

    /// `t` (value-shaped) in the leaf's form: the chain's dims in order,
    /// contiguous, then each padded to the ratio of its stride to the next
    /// (the innermost to its stride), so that the first elements of each
    /// axis have the forward's strides.
    fn pack(&self, t: &Tensor) -> Result<Tensor> {
        let mut g = t.clone();
        for i in self.outside().collect::<Vec<_>>().into_iter().rev() {
            g = g.narrow(i, 0, 1)?.squeeze(i)?;
        }
        let k = self.chain.len();
        let mut packed = g
            .permute(self.permutations().0)?
            .contiguous()?
            .unsqueeze(k)?;
        for (axis, (size, room)) in self.axes().into_iter().enumerate().skip(1) {
            packed = packed.pad_with_zeros(axis, 0, room - size)?;
        }
        Ok(packed)
    }

    /// The permutations from the chain's dims in the value's order to the
    /// chain's order, and back.
    fn permutations(&self) -> (Vec<usize>, Vec<usize>) {
        let ordered: Vec<usize> = (0..self.dims.len())
            .filter(|i| self.chain.contains(i))
            .collect();
        let at = |list: &[usize], i: usize| list.iter().position(|&j| j == i).unwrap_or(0);
        let to_chain = self.chain.iter().map(|&i| at(&ordered, i)).collect();
        let back = ordered.iter().map(|&i| at(&self.chain, i)).collect();
        (to_chain, back)
    }

    /// Each axis of the packed form: (the dim it holds, its padded size).
    fn axes(&self) -> Vec<(usize, usize)> {
        let (c, s, d) = (&self.chain, &self.strides, &self.dims);
        let k = c.len();
        let mut axes = vec![(d[c[0]], d[c[0]])];
        axes.extend((1..k).map(|j| (d[c[j]], s[c[j - 1]] / s[c[j]])));
        axes.push((1, s[c[k - 1]]));
        axes
    }

    /// The packed `t` seen with the value's dims in their order, the dims
    /// outside the chain of size 1 (all of them, or past the leading ones
    /// when `leading_later`: `broadcast_as` adds those).
    fn unpack(&self, t: &Tensor, leading_later: bool) -> Result<Tensor> {
        let k = self.chain.len();
        let mut view = t.clone();
        for (axis, (size, _)) in self.axes().into_iter().enumerate().skip(1) {
            view = view.narrow(axis, 0, size)?;
        }
        let view = view.squeeze(k)?;
        let mut view = view.permute(self.permutations().1)?;
        let leading = match leading_later {
            true => (0..self.dims.len())
                .take_while(|i| !self.chain.contains(i))
                .count(),
            false => 0,
        };
        for i in self.outside().filter(|&i| i >= leading) {
            view = view.unsqueeze(i - leading)?;
        }
        Ok(view)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::Relayout;

    /// Views a block may read, each from a contiguous base of 2 x 3 x 4 x 6.
    /// With the dims each broadcasts (whose gradient the leaf gets summed,
    /// at the first element: the producer's broadcast sums them anyway).
    fn views(base: &Tensor) -> Vec<(&'static str, Tensor, Vec<usize>)> {
        let b = base.clone();
        let packed = b.reshape((2, 3, 4, 2, 3)).unwrap();
        vec![
            ("transpose", b.transpose(1, 3).unwrap(), vec![]),
            ("permute", b.permute((3, 0, 2, 1)).unwrap(), vec![]),
            ("chunk of the last dim", b.narrow(3, 2, 2).unwrap(), vec![]),
            ("narrow of a middle dim", b.narrow(1, 1, 2).unwrap(), vec![]),
            (
                "stride 3 innermost",
                packed.narrow(4, 1, 1).unwrap().squeeze(4).unwrap(),
                vec![],
            ),
            (
                "chunk, transposed",
                b.narrow(3, 3, 3).unwrap().transpose(1, 2).unwrap(),
                vec![],
            ),
            (
                "a size-1 dim",
                b.narrow(1, 2, 1).unwrap().transpose(2, 3).unwrap(),
                vec![],
            ),
            (
                "broadcast",
                b.narrow(1, 0, 1)
                    .unwrap()
                    .broadcast_as((5, 2, 3, 4, 6))
                    .unwrap(),
                vec![0, 2],
            ),
            (
                "broadcast inside",
                b.narrow(2, 1, 1)
                    .unwrap()
                    .broadcast_as((2, 3, 5, 6))
                    .unwrap(),
                vec![2],
            ),
        ]
    }

    #[test]
    fn a_leaf_in_memory_order_reads_as_the_view_and_gives_its_gradient() {
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let n = 2 * 3 * 4 * 6;
            let base = Tensor::arange(0f64, n as f64, &Device::Cpu)
                .unwrap()
                .reshape((2, 3, 4, 6))
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            for (name, v, broadcast) in views(&base) {
                let r = Relayout::of(v.layout(), v.device()).unwrap();
                let leaf = r.leaf(&v).unwrap();
                assert!(leaf.is_variable(), "{name}");
                let read = r.read(&leaf).unwrap();
                assert_eq!(
                    (read.dims(), read.stride()),
                    (v.dims(), v.stride()),
                    "{name}"
                );
                let f64s = |t: &Tensor| {
                    let t = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
                    t.to_vec1::<f64>().unwrap()
                };
                assert_eq!(f64s(&read), f64s(&v), "{name}");
                let w: Vec<f64> = (0..v.elem_count()).map(|i| (i % 4 + 1) as f64).collect();
                let w = Tensor::from_vec(w, v.dims(), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let g = (read * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let g = r.grad(g.get(&leaf).unwrap()).unwrap();
                assert_eq!(g.dims(), v.dims(), "{name}");
                let summed = |t: &Tensor| {
                    let t = t.to_dtype(DType::F64).unwrap();
                    f64s(&broadcast.iter().fold(t, |t, &d| t.sum_keepdim(d).unwrap()))
                };
                assert_eq!(summed(&g), summed(&w), "{name}");
            }
            // A transpose's leaf is as large as the value.
            let t = base.transpose(1, 3).unwrap();
            let r = Relayout::of(t.layout(), t.device()).unwrap();
            assert_eq!(r.leaf(&t).unwrap().elem_count(), n);
        }
    }

    #[test]
    fn a_contiguous_value_needs_no_relayout() {
        let base = Tensor::zeros((4, 6), DType::F32, &Device::Cpu).unwrap();
        for v in [
            base.clone(),
            base.narrow(0, 1, 2).unwrap(),
            base.narrow(1, 0, 0).unwrap(),
        ] {
            assert!(Relayout::of(v.layout(), v.device()).is_none());
        }
        let t = base.t().unwrap();
        assert!(Relayout::of(t.layout(), t.device()).is_some());
    }
}
