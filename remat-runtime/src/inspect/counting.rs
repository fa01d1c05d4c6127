//! A counting global allocator: exact live and peak bytes on the CPU.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A global allocator that forwards to [`System`] and counts the bytes
/// allocated and not yet freed, and their high-water mark. candle has no
/// memory API; on the CPU this gives exact figures for tests and benchmarks.
///
/// ```
/// use remat_runtime::inspect::CountingAlloc;
///
/// #[global_allocator]
/// static ALLOC: CountingAlloc = CountingAlloc::new();
///
/// let before = ALLOC.live();
/// let v = vec![0u8; 1 << 20];
/// assert_eq!(ALLOC.live() - before, 1 << 20);
/// drop(v);
/// assert_eq!(ALLOC.live(), before);
/// ```
pub struct CountingAlloc {
    live: AtomicUsize,
    peak: AtomicUsize,
    largest: AtomicUsize,
}

impl CountingAlloc {
    /// A counter at zero, for a `static`.
    ///
    /// ```
    /// static A: remat_runtime::inspect::CountingAlloc = remat_runtime::inspect::CountingAlloc::new();
    /// assert_eq!(A.live(), 0);
    /// ```
    pub const fn new() -> Self {
        CountingAlloc {
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            largest: AtomicUsize::new(0),
        }
    }

    /// Bytes allocated and not yet freed.
    ///
    /// ```
    /// static A: remat_runtime::inspect::CountingAlloc = remat_runtime::inspect::CountingAlloc::new();
    /// assert_eq!(A.live(), 0); // not installed: nothing counted
    /// ```
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// The most bytes live at once since the last [`CountingAlloc::reset_peak`].
    ///
    /// ```
    /// static A: remat_runtime::inspect::CountingAlloc = remat_runtime::inspect::CountingAlloc::new();
    /// assert_eq!(A.peak(), 0);
    /// ```
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    /// The size of the largest single allocation since the last
    /// [`CountingAlloc::reset_peak`]: whether a tensor of some size was
    /// ever made (a `(tokens, vocabulary)` block of logits, say).
    ///
    /// ```
    /// static A: remat_runtime::inspect::CountingAlloc = remat_runtime::inspect::CountingAlloc::new();
    /// assert_eq!(A.largest(), 0);
    /// ```
    pub fn largest(&self) -> usize {
        self.largest.load(Ordering::SeqCst)
    }

    /// Starts a new peak measurement at the current live bytes, and a new
    /// [`largest`](CountingAlloc::largest) allocation at zero.
    ///
    /// ```
    /// static A: remat_runtime::inspect::CountingAlloc = remat_runtime::inspect::CountingAlloc::new();
    /// A.reset_peak();
    /// assert_eq!(A.peak(), A.live());
    /// ```
    pub fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::SeqCst);
        self.largest.store(0, Ordering::SeqCst);
    }

    fn grew(&self, bytes: usize) {
        let now = self.live.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
        self.largest.fetch_max(bytes, Ordering::SeqCst);
    }
}

impl Default for CountingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees are what the caller gets; the counters
// only do arithmetic on atomics and never touch the memory.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            self.grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; `ptr` came from `System` via `alloc`.
        unsafe { System.dealloc(ptr, layout) };
        self.live.fetch_sub(layout.size(), Ordering::SeqCst);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged; `ptr` came from `System` via `alloc`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            self.live.fetch_sub(layout.size(), Ordering::SeqCst);
            self.grew(new_size);
        }
        p
    }
}
