//! An interrupt (Ctrl-C, through `commfuse_interrupt`) ends the waits under
//! way at once and leaves later calls alone. A test binary of its own: the
//! interrupt count is process-wide, and would end the waits of other tests.

use commfuse::backend::cpu::transport::{Block, Endpoint, Participant, SessionKey};
use commfuse::error::Error;
use commfuse::exec::Wait;
use commfuse::plan::{Direction, Tag};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The tests interrupt one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn endpoint(site: i64, rank: usize) -> Endpoint {
    let key = SessionKey { group: vec![0, 1], site, run: 1, sequence: 0 };
    let info = Participant {
        op: "all_gather_matmul",
        rank,
        timeout: Duration::from_secs(30),
        interrupts: commfuse::config::interrupts(),
    };
    Endpoint::join(key, info)
}

fn recv(end: &Endpoint, from: usize) -> Result<Instant, Error> {
    let cancelled = AtomicBool::new(false);
    let tag = Tag { direction: Direction::Forward, step: 0 };
    end.recv(from, tag, 8, &Wait::unwatched(&cancelled)).map(|(_, arrived)| arrived)
}

#[test]
fn an_interrupt_ends_a_wait_at_once_and_later_calls_run() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let waiting = endpoint(1, 0);
    let start = Instant::now();
    let interrupter = std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(100));
        commfuse::exports::python::commfuse_interrupt();
    });
    let e = recv(&waiting, 1).unwrap_err();
    interrupter.join().unwrap();
    assert!(start.elapsed() < Duration::from_secs(2), "{:?} with a 30 s timeout", start.elapsed());
    let Error::Interrupted(message) = &e else { panic!("{e:?}") };
    assert!(message.contains("all_gather_matmul") && message.contains("interrupted (SIGINT)"), "{message}");
    drop(waiting);

    // A call that begins after the interrupt is not affected by it.
    let (a, b) = (endpoint(2, 0), endpoint(2, 1));
    a.send(1, Tag { direction: Direction::Forward, step: 0 }, Arc::new(Block::copy_of(&[7; 8])), Instant::now());
    recv(&b, 0).unwrap();
}

#[cfg(feature = "cuda")]
#[test]
fn an_interrupt_ends_a_host_side_poll_of_the_cuda_backend() {
    use commfuse::backend::cuda::addresses::{poll_until, Poll};
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let start = Instant::now();
    let interrupter = std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(100));
        commfuse::config::interrupt();
    });
    let e = poll_until(start + Duration::from_secs(30), "an NCCL group", || Ok(Poll::Pending)).unwrap_err();
    interrupter.join().unwrap();
    assert!(matches!(&e, Error::Interrupted(m) if m.contains("an NCCL group")), "{e:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
}
