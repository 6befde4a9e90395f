//! Memory-level pieces the core's arrays share: the index that means
//! "none" in their intrusive lists, and hints to the kernel and the CPU.

/// Marks the end of the free list or "no waiters".
pub const NIL: u32 = u32::MAX;

/// Asks the kernel to back `count` elements at `start` with transparent
/// huge pages when the array is large. A lookup in a table of a million
/// keys lands on a random page of ~60 MB: with 4 KiB pages nearly every
/// lookup also misses the TLB, and in a VM each of those is a
/// two-dimensional page walk. Measured: ~20 % less server CPU per request
/// at 1,000,000 held (docs/BENCHMARKS.md). Only a hint; errors are ignored
/// and other systems do nothing.
pub(super) fn advise_huge_pages<T>(start: *const T, count: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    let bytes = count.saturating_mul(size_of::<T>());
    if bytes < 2 * HUGE_PAGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // madvise wants a page-aligned start; the range is rounded inward.
        const PAGE: usize = 4096;
        let address = start as usize;
        let aligned = address.next_multiple_of(PAGE);
        let length = bytes - (aligned - address);
        // SAFETY: MADV_HUGEPAGE changes no contents and no mapping; the
        // range lies inside one live allocation.
        unsafe {
            libc::madvise(aligned as *mut libc::c_void, length, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = start;
}

/// A hint to start loading the cache line at `address`; no effect on
/// targets without a prefetch instruction.
#[inline(always)]
pub(super) fn prefetch_read(address: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and has no effect on program state;
    // the address is that of a live entry anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch(address.cast(), std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}
