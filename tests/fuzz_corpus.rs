//! Replays the fuzzers' corpus (`fuzz/corpus/`, grown by `cargo fuzz`) through
//! the same cases and checks, so every `cargo test` runs it. A test binary of
//! its own: the frame cases set a short deadline for the whole process.

use std::path::Path;

/// Held while replaying: an error a corrupted frame cannot report waits,
/// process-wide, for the next handler call (`xla::take_unreported`), which
/// must be the same replay's.
static REPLAYING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn replay(target: &str, run: fn(&[u8])) {
    let _serial = REPLAYING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a corpus entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "the {target} corpus in {} is empty", dir.display());
    for file in &files {
        let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        // A panic names the file: the failing input to reproduce with.
        if std::panic::catch_unwind(|| run(&data)).is_err() {
            panic!("{target} corpus file {} fails its checks", file.display());
        }
    }
    eprintln!("{target}: {} corpus files replayed", files.len());
}

#[test]
fn the_frame_corpus_passes() {
    replay("frame", commfuse::fuzzing::frame_target);
}

#[test]
fn the_planner_corpus_passes() {
    replay("planner", commfuse::fuzzing::planner_target);
}

#[test]
fn the_reshard_frame_corpus_passes() {
    replay("reshard_frame", commfuse::fuzzing::reshard_frame_target);
}
