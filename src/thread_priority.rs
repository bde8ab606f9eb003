//! Running a thread below its peers: the executor's compute lanes yield
//! their core to a comm lane that wakes (see `exec::run`).
//!
//! On Linux a nice value belongs to one thread, and a thread may always
//! lower its own priority; elsewhere nice applies to the whole process, so
//! nothing is changed there.

/// How many nice levels below the caller's thread a compute lane runs.
/// Linux's scheduler lets a nice-0 thread that wakes preempt a nice-5 one,
/// and gives the nice-5 thread a quarter of a core that a busy nice-0
/// thread also wants (weights 335 and 1024). The comm lanes' precedence
/// measured the same at 5 and 10 (`python -m commfuse.bench_two_axis`); 5
/// starves less the GEMMs of a device whose core XLA's own work wants.
pub const COMPUTE_LANE_NICE: i32 = 5;

/// Lowers the calling thread's priority by `COMPUTE_LANE_NICE` levels. A
/// failure leaves it as it was: priority only changes how soon a lane gets a
/// core, never what it computes.
pub fn lower_this_thread() {
    #[cfg(target_os = "linux")]
    // SAFETY: `nice` takes an integer and changes only the calling thread's
    // scheduling priority on Linux; no memory is passed.
    unsafe {
        libc::nice(COMPUTE_LANE_NICE);
    }
}

/// The calling thread's nice value (Linux; 0 elsewhere), for tests.
#[cfg(test)]
pub fn nice_of_this_thread() -> i32 {
    #[cfg(target_os = "linux")]
    // SAFETY: reads the calling thread's priority; no memory is passed.
    return unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    #[cfg(not(target_os = "linux"))]
    0
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::nice_of_this_thread as nice_now;

    #[test]
    fn only_the_calling_thread_is_lowered() {
        let before = nice_now();
        let lowered = std::thread::spawn(|| {
            let start = nice_now();
            super::lower_this_thread();
            (start, nice_now())
        })
        .join()
        .unwrap();
        assert_eq!(lowered.1, (lowered.0 + super::COMPUTE_LANE_NICE).min(19), "the lane thread: {lowered:?}");
        assert_eq!(nice_now(), before, "the caller's thread is left as it was");
    }
}
