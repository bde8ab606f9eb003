//! The CPU handler's body: decode the call, then run it on a thread of its
//! own, finishing through XLA's future (`xla::Deferred`), so that a call
//! waiting for its peers never holds a thread XLA needs for its own
//! collectives.
#![forbid(unsafe_code)]

use super::transport::{self, link::LinkModel, Endpoint, SessionKey};
use crate::activity;
use crate::call::Call;
use crate::error::{Error, Result};
use crate::exec::Observer;
use crate::trace::{CallLabel, Recording};
use crate::xla::{Frame, Stage};

/// One device's call of a fused op on the CPU backend.
pub fn collective_matmul(frame: &mut Frame<'_>) -> Result<()> {
    if frame.stage() == Stage::Instantiate {
        return crate::call::instantiate(frame);
    }
    let call = CpuCall::decode(frame)?;
    let names = Call::operand_names(frame);
    let inside = call.enter();
    run_off_xla_thread(frame, "commfuse collective matmul", &names, &["out", "workspace"], move |args, rets| {
        // Left when the work ends, before XLA's future completes.
        let _inside = inside;
        call.run(args, rets)
    })
}

/// Runs a decoded call on a thread of its own, finishing through XLA's
/// future; in place on an XLA without FFI futures, on the operands and
/// results named `operands` and `results` (for errors about them).
pub fn run_off_xla_thread(
    frame: &mut Frame<'_>,
    name: &'static str,
    operands: &[&str],
    results: &[&str],
    run: impl FnOnce(&[&[u8]], &mut [&mut [u8]]) -> Result<()> + Send + 'static,
) -> Result<()> {
    match frame.defer(name)? {
        Some(deferred) => {
            crate::exec::spawn_call(move || deferred.finish(run));
            Ok(())
        }
        None => {
            let args = operands.iter().enumerate().map(|(i, n)| frame.arg_bytes(i, n)).collect::<Result<Vec<_>>>()?;
            let mut rets = Vec::with_capacity(results.len());
            for (i, n) in results.iter().enumerate() {
                rets.push(frame.ret_bytes(i, n)?);
            }
            run(&args, &mut rets)
        }
    }
}

/// A decoded call with what only the CPU backend needs, owned, so it can
/// run on another thread.
struct CpuCall {
    call: Call,
    device: i64,
    key: SessionKey,
    link: Option<LinkModel>,
}

impl CpuCall {
    fn decode(frame: &Frame<'_>) -> Result<CpuCall> {
        let [first, second] = Call::operand_names(frame);
        let x = frame.arg(0, first)?;
        let w = frame.arg(1, second)?;
        let (out_dtype, out_dims) = frame.ret_type(0, "out")?;
        let device = i64::from(frame.device_ordinal()?);
        let call = Call::decode(frame, [(x.dims, x.dtype), (w.dims, w.dtype), (out_dims, out_dtype)], device)?;
        let run = frame.run_id()?;
        // Numbered here, in the order XLA calls the handler on this device.
        let key = SessionKey {
            sequence: transport::next_sequence(device, call.site, run),
            group: call.group.devices.clone(),
            site: call.site,
            run,
        };
        // The link model as it is when the program runs (read on every call).
        Ok(CpuCall { call, device, key, link: LinkModel::from_env()? })
    }

    /// Records that this call's device is inside it (`activity`), until
    /// the result is dropped.
    fn enter(&self) -> activity::Inside {
        let identity = activity::CallIdentity {
            kind: self.call.kind.name(),
            site: self.key.site,
            run: Some(self.key.run),
            sequence: self.key.sequence,
        };
        activity::enter(self.device, identity)
    }

    /// Meets the peers and runs the plan on the call's buffers: operands
    /// `x`, `w`, results `out`, `workspace`.
    fn run(self, args: &[&[u8]], rets: &mut [&mut [u8]]) -> Result<()> {
        let counts = (args.len(), rets.len());
        let ([x, w], [out, workspace]) = (args, rets) else {
            return Err(Error::InvalidArgument(format!(
                "the call has {} operands and {} results; expected x, w and out, workspace",
                counts.0, counts.1
            )));
        };
        let CpuCall { call, device, key, link } = self;
        if call.problem.is_trivial() {
            // Every rank has these shapes and skips alike: no peer to meet.
            out.fill(0);
            return Ok(());
        }
        let participant = transport::Participant {
            op: call.kind.name(),
            rank: call.group.rank,
            timeout: call.timeout,
            interrupts: call.interrupts,
        };
        let lanes = super::Lanes::by_work(call.flops, link.is_some(), call.group.size());
        let endpoint = Endpoint::join(key, participant).with_link(link);
        let recording = Recording::begin(&call.plan, || {
            CallLabel::new(device, call.site, call.kind.name(), &call.plan, &call.problem, x.len())
        });
        let buffers = super::Buffers { x, w, out, workspace };
        let observer = recording.as_ref().map(|r| r as &dyn Observer);
        let result = super::run(&call.problem, &call.plan, buffers, &endpoint, observer, lanes);
        if let Err(e) = &result {
            endpoint.fail(e);
            // Also said here: other devices of this program may be waiting in
            // one of XLA's collectives for this one, and XLA aborts the
            // process when its own rendezvous times out, before Python could
            // show the error.
            if matches!(e, Error::DeadlineExceeded(_)) {
                eprintln!("{e}");
            }
        }
        result
    }
}
