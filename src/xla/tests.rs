//! Tests of the call-frame layer on synthetic call frames: a fake API table
//! records the errors handlers create, and every pointer a frame holds points
//! into an arena the test owns.

use std::ptr;

use super::synthetic::*;
use super::{error_code, handle, sys};
use crate::dtype::DType;
use crate::error::Error;

// ---- buffers ---------------------------------------------------------------

#[test]
fn decodes_operands_and_results() {
    let built = Call {
        args: vec![f32_arg(&[2, 3]), (sys::XLA_FFI_DataType_BF16, vec![4]), (sys::XLA_FFI_DataType_F64, vec![])],
        rets: vec![(sys::XLA_FFI_DataType_F16, vec![5, 1])],
        ..Default::default()
    }
    .build();
    let mut frame = built.frame();
    assert_eq!((frame.num_args(), frame.num_rets()), (3, 1));

    let x = frame.arg(0, "x").unwrap();
    assert_eq!((x.dtype, x.dims, x.data.len()), (DType::F32, &[2i64, 3][..], 24));
    let expected: Vec<u8> = (0..24).map(|i| (i * 7) as u8).collect();
    assert_eq!(x.data, &expected[..]);
    assert_eq!(x.data.as_ptr(), unsafe { (*built.arg_bufs[0]).data } as *const u8);

    let y = frame.arg(1, "y").unwrap();
    assert_eq!((y.dtype, y.dims, y.data.len()), (DType::BF16, &[4i64][..], 8));
    let s = frame.arg(2, "s").unwrap();
    assert_eq!((s.dtype, s.dims.len(), s.data.len()), (DType::F64, 0, 8));

    let out = frame.take_ret(0, "out").unwrap();
    assert_eq!((out.dtype, out.dims, out.data.len()), (DType::F16, &[5i64, 1][..], 10));
    out.data.fill(0xab);
    let raw = unsafe { std::slice::from_raw_parts((*built.ret_bufs[0]).data as *const u8, 10) };
    assert!(raw.iter().all(|&b| b == 0xab));
}

#[test]
fn empty_buffer_may_have_null_data() {
    let built = Call { args: vec![f32_arg(&[0, 8])], ..Default::default() }.build();
    let x = built.arg_bufs[0];
    unsafe { (*x).data = ptr::null_mut() };
    let x = built.frame().arg(0, "x").unwrap();
    assert_eq!((x.dims, x.data.len()), (&[0i64, 8][..], 0));
}

#[test]
fn wrong_dtype_names_the_operand() {
    let built = Call {
        args: vec![(sys::XLA_FFI_DataType_S32, vec![3])],
        rets: vec![(sys::XLA_FFI_DataType_PRED, vec![3])],
        ..Default::default()
    }
    .build();
    let mut frame = built.frame();
    let err = frame.arg(0, "x").err().unwrap();
    assert_eq!(
        err,
        Error::InvalidArgument("operand `x` has dtype int32; expected float32, float64, bfloat16 or float16".into())
    );
    let err = frame.take_ret(0, "out").err().unwrap();
    assert!(matches!(&err, Error::InvalidArgument(m) if m.starts_with("result `out` has dtype bool")), "{err}");
}

#[test]
fn out_of_range_index_names_the_operand() {
    let built = Call { args: vec![f32_arg(&[1])], ..Default::default() }.build();
    let mut frame = built.frame();
    let err = frame.arg(1, "w").err().unwrap();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("operand `w`") && m.contains("1 operands")),
        "{err}"
    );
    let err = frame.take_ret(0, "out").err().unwrap();
    assert!(matches!(&err, Error::InvalidArgument(m) if m.contains("result `out`")), "{err}");
}

#[test]
fn negative_dimension_is_rejected() {
    let built = Call { args: vec![f32_arg(&[2, -1])], ..Default::default() }.build();
    let err = built.frame().arg(0, "x").err().unwrap();
    assert!(matches!(&err, Error::InvalidArgument(m) if m.contains("operand `x` has bad shape")), "{err}");
}

#[test]
fn raw_bytes_of_u8_workspace() {
    let built = Call {
        args: vec![(sys::XLA_FFI_DataType_U8, vec![16])],
        rets: vec![f32_arg(&[2]), (sys::XLA_FFI_DataType_U8, vec![3, 100])],
        ..Default::default()
    }
    .build();
    let mut frame = built.frame();
    assert_eq!(frame.arg_bytes(0, "blob").unwrap().len(), 16);
    let ws = frame.ret_bytes(1, "workspace").unwrap();
    assert_eq!(ws.len(), 300);
    ws.fill(1);
    // The typed accessor still refuses uint8.
    assert!(frame.arg(0, "blob").is_err());
}

#[test]
fn a_result_is_taken_at_most_once() {
    let built = Call { rets: vec![f32_arg(&[4]), f32_arg(&[4])], ..Default::default() }.build();
    let mut frame = built.frame();
    let first = frame.take_ret(0, "out").unwrap();
    let err = frame.take_ret(0, "out").err().unwrap();
    assert!(matches!(&err, Error::Internal(m) if m.contains("result `out`") && m.contains("twice")), "{err}");
    assert!(matches!(frame.ret_bytes(0, "out"), Err(Error::Internal(_))));
    // Another result is still available, and the first stays usable.
    let second = frame.ret_bytes(1, "other").unwrap();
    second.fill(2);
    first.data.fill(1);
}

#[test]
fn a_result_aliasing_an_operand_is_refused() {
    let built = Call { args: vec![f32_arg(&[4])], rets: vec![f32_arg(&[4])], ..Default::default() }.build();
    let (x, out) = (built.arg_bufs[0], built.ret_bufs[0]);
    unsafe { (*out).data = (*x).data };
    let err = built.frame().take_ret(0, "out").err().unwrap();
    assert!(matches!(&err, Error::Internal(m) if m.contains("shares memory with operand 0")), "{err}");
}

// ---- attributes --------------------------------------------------------------

fn attr_call() -> Built {
    Call {
        attrs: vec![
            ("site", Attr::I64(-7_000_000_000)),
            ("small", Attr::I32(-5)),
            ("scale", Attr::F32(0.5)),
            ("axes", Attr::I64s(vec![3, 1, 2])),
            ("empty", Attr::I64s(vec![])),
            ("mode", Attr::Str("ring")),
        ],
        ..Default::default()
    }
    .build()
}

#[test]
fn decodes_attributes() {
    let built = attr_call();
    let frame = built.frame();
    assert_eq!(frame.attr_i64("site").unwrap(), -7_000_000_000);
    assert_eq!(frame.attr_i64("small").unwrap(), -5);
    assert_eq!(frame.attr_i64_array("axes").unwrap(), &[3, 1, 2]);
    assert_eq!(frame.attr_i64_array("empty").unwrap(), &[] as &[i64]);
    assert_eq!(frame.attr_str("mode").unwrap(), "ring");
    assert!(frame.has_attr("mode") && !frame.has_attr("mod"));
}

#[test]
fn missing_attribute_is_named() {
    let built = attr_call();
    let err = built.frame().attr_i64("chunks").err().unwrap();
    assert_eq!(err, Error::InvalidArgument("missing attribute `chunks`".into()));
    assert!(built.frame().attr_str("chunk").is_err());
}

#[test]
fn wrong_attribute_kind_is_named() {
    let built = attr_call();
    let frame = built.frame();
    let cases = [
        (frame.attr_i64("mode").err(), "attribute `mode` is a string; expected an integer scalar"),
        (frame.attr_i64("scale").err(), "attribute `scale` is a float32 scalar; expected an integer scalar"),
        (frame.attr_i64_array("site").err(), "attribute `site` is a int64 scalar; expected an array of int64"),
        (frame.attr_str("axes").err(), "attribute `axes` is an array of int64; expected a string"),
    ];
    for (err, msg) in cases {
        assert_eq!(err, Some(Error::InvalidArgument(msg.into())));
    }
}

// ---- API calls -----------------------------------------------------------------

#[test]
fn device_ordinal_and_run_id_come_from_the_api() {
    let built = Call::default().build();
    let frame = built.frame();
    assert_eq!(frame.device_ordinal().unwrap(), DEVICE_ORDINAL);
    assert_eq!(frame.run_id().unwrap(), RUN_ID);
}

#[test]
fn api_errors_become_internal() {
    let built = Call::default().build();
    unsafe { (*built.api).XLA_FFI_RunId_Get = Some(failing_run_id) };
    let err = built.frame().run_id().err().unwrap();
    assert_eq!(err, Error::Internal("XLA_FFI_RunId_Get failed: no run id here".into()));

    // An API table too short to have the function (an older XLA).
    unsafe { (*built.api).struct_size = std::mem::offset_of!(sys::XLA_FFI_Api, XLA_FFI_RunId_Get) };
    assert!(matches!(built.frame().device_ordinal(), Err(Error::Unimplemented(_))));
}

#[test]
fn stream_comes_from_the_api_and_is_an_error_on_cpu() {
    let built = Call::default().build();
    // The default fake table has no Stream_Get, like a CPU-only table.
    assert!(matches!(built.frame().stream(), Err(Error::Unimplemented(_))));
    unsafe { (*built.api).XLA_FFI_Stream_Get = Some(fake_stream) };
    assert_eq!(built.frame().stream().unwrap() as usize, STREAM);
    unsafe { (*built.api).XLA_FFI_Stream_Get = Some(cpu_stream) };
    let err = built.frame().stream().err().unwrap();
    assert_eq!(err, Error::Internal("XLA_FFI_Stream_Get failed: XLA FFI GPU context is not available".into()));
    unsafe { (*built.api).XLA_FFI_Stream_Get = Some(null_stream) };
    assert!(matches!(built.frame().stream(), Err(Error::Internal(m)) if m.contains("no stream")));
    // A table too short to have it.
    unsafe {
        (*built.api).XLA_FFI_Stream_Get = Some(fake_stream);
        (*built.api).struct_size = std::mem::offset_of!(sys::XLA_FFI_Api, XLA_FFI_Stream_Get);
    }
    assert!(matches!(built.frame().stream(), Err(Error::Unimplemented(_))));
}

// ---- device buffers ----------------------------------------------------------------

#[test]
fn device_buffers_give_addresses_and_lengths_without_slices() {
    let built = Call {
        args: vec![f32_arg(&[2, 3]), (sys::XLA_FFI_DataType_BF16, vec![4])],
        rets: vec![(sys::XLA_FFI_DataType_F16, vec![5, 1]), (sys::XLA_FFI_DataType_U8, vec![3, 100])],
        ..Default::default()
    }
    .build();
    let mut frame = built.frame();
    let data = |b: *mut sys::XLA_FFI_Buffer| unsafe { (*b).data } as u64;
    let x = frame.device_arg(0, "x").unwrap();
    assert_eq!((x.dtype, x.dims, x.addr, x.bytes), (DType::F32, &[2i64, 3][..], data(built.arg_bufs[0]), 24));
    let w = frame.device_arg(1, "w").unwrap();
    assert_eq!((w.dtype, w.dims, w.addr, w.bytes), (DType::BF16, &[4i64][..], data(built.arg_bufs[1]), 8));
    // Operands can be described any number of times.
    assert_eq!(frame.device_arg(0, "x").unwrap().addr, x.addr);

    let out = frame.device_ret(0, "out").unwrap();
    assert_eq!((out.dtype, out.dims, out.addr, out.bytes), (DType::F16, &[5i64, 1][..], data(built.ret_bufs[0]), 10));
    let ws = frame.device_ret_bytes(1, "workspace").unwrap();
    assert_eq!((ws.dims, ws.addr, ws.bytes), (&[3i64, 100][..], data(built.ret_bufs[1]), 300));
    // Each result once, whichever accessor took it.
    for err in [
        frame.device_ret(0, "out").err(),
        frame.take_ret(0, "out").err(),
        frame.device_ret_bytes(1, "workspace").err(),
        frame.ret_bytes(1, "workspace").err(),
    ] {
        assert!(matches!(&err, Some(Error::Internal(m)) if m.contains("twice")), "{err:?}");
    }
}

#[test]
fn device_buffers_are_checked_like_host_ones() {
    let built = Call {
        args: vec![(sys::XLA_FFI_DataType_S32, vec![3]), f32_arg(&[0, 8]), f32_arg(&[2, -1]), f32_arg(&[4])],
        rets: vec![(sys::XLA_FFI_DataType_PRED, vec![3]), f32_arg(&[4]), f32_arg(&[4])],
        ..Default::default()
    }
    .build();
    let (empty_arg, full_arg) = (built.arg_bufs[1], built.arg_bufs[3]);
    let (ret1, ret2) = (built.ret_bufs[1], built.ret_bufs[2]);
    let mut frame = built.frame();
    let err = frame.device_arg(0, "x").err().unwrap();
    assert!(matches!(&err, Error::InvalidArgument(m) if m.starts_with("operand `x` has dtype int32")), "{err}");
    let err = frame.device_ret(0, "out").err().unwrap();
    assert!(matches!(&err, Error::InvalidArgument(m) if m.starts_with("result `out` has dtype bool")), "{err}");
    let err = frame.device_arg(2, "bad").err().unwrap();
    assert!(matches!(&err, Error::InvalidArgument(m) if m.contains("bad shape")), "{err}");
    let err = frame.device_arg(9, "w").err().unwrap();
    assert!(matches!(&err, Error::InvalidArgument(m) if m.contains("operand `w` (index 9)")), "{err}");
    // An empty buffer may have no address; a non-empty one must.
    unsafe { (*empty_arg).data = ptr::null_mut() };
    let empty = frame.device_arg(1, "empty").unwrap();
    assert_eq!((empty.addr, empty.bytes), (0, 0));
    unsafe { (*full_arg).data = ptr::null_mut() };
    assert!(matches!(frame.device_arg(3, "x"), Err(Error::Internal(m)) if m.contains("no data")));
    // A result aliasing an operand or another result is refused.
    unsafe { (*ret2).data = (*ret1).data };
    let err = frame.device_ret(2, "out2").err().unwrap();
    assert!(matches!(&err, Error::Internal(m) if m.contains("shares memory with result 1")), "{err}");
    // The ordinal (device id) a GPU handler needs comes with it.
    assert_eq!(frame.device_ordinal().unwrap(), DEVICE_ORDINAL);
}

// ---- the handler wrapper ---------------------------------------------------------

#[test]
fn metadata_probe_is_answered_without_running_the_body() {
    let mut metadata = sys::XLA_FFI_Metadata {
        struct_size: sys::XLA_FFI_Metadata_STRUCT_SIZE as usize,
        traits: 0xffff,
        ..Default::default()
    };
    let mut ext = sys::XLA_FFI_Metadata_Extension {
        extension_base: sys::XLA_FFI_Extension_Base {
            struct_size: sys::XLA_FFI_Metadata_Extension_STRUCT_SIZE as usize,
            type_: sys::XLA_FFI_Extension_Metadata,
            next: ptr::null_mut(),
        },
        metadata: &mut metadata,
    };
    // Like XLA's probe: only the header of the call frame, no API table.
    let mut frame = sys::XLA_FFI_CallFrame {
        struct_size: sys::XLA_FFI_CallFrame_STRUCT_SIZE as usize,
        extension_start: &mut ext.extension_base,
        ..Default::default()
    };
    let mut ran = false;
    let err = unsafe {
        handle(&mut frame, |_| {
            ran = true;
            Ok(())
        })
    };
    assert!(err.is_null());
    assert!(!ran);
    assert_eq!(metadata.api_version.major_version, sys::XLA_FFI_API_MAJOR as i32);
    assert_eq!(metadata.api_version.minor_version, sys::XLA_FFI_API_MINOR as i32);
    assert_eq!(metadata.api_version.struct_size, sys::XLA_FFI_Api_Version_STRUCT_SIZE as usize);
    assert_eq!(metadata.traits, 0);
}

#[test]
fn other_stages_skip_the_body() {
    for stage in [
        sys::XLA_FFI_ExecutionStage_INSTANTIATE,
        sys::XLA_FFI_ExecutionStage_PREPARE,
        sys::XLA_FFI_ExecutionStage_INITIALIZE,
    ] {
        let built = Call { stage, ..Default::default() }.build();
        let mut ran = false;
        let err = built.handle(|_| {
            ran = true;
            Ok(())
        });
        assert_eq!(err, None);
        assert!(!ran, "stage {stage}");
    }
}

#[test]
fn execute_runs_the_body() {
    let built = Call { args: vec![f32_arg(&[2])], rets: vec![f32_arg(&[2])], ..Default::default() }.build();
    let err = built.handle(|frame| {
        let x = frame.arg(0, "x")?;
        let out = frame.take_ret(0, "out")?;
        out.data.copy_from_slice(x.data);
        Ok(())
    });
    assert_eq!(err, None);
    let (x, out) = unsafe { ((*built.arg_bufs[0]).data as *const u8, (*built.ret_bufs[0]).data as *const u8) };
    assert_eq!(unsafe { std::slice::from_raw_parts(x, 8) }, unsafe { std::slice::from_raw_parts(out, 8) });
}

#[test]
fn body_errors_are_reported_with_their_code() {
    let cases = [
        (Error::InvalidArgument("bad x".into()), sys::XLA_FFI_Error_Code_INVALID_ARGUMENT),
        (Error::Unimplemented("no cuda".into()), sys::XLA_FFI_Error_Code_UNIMPLEMENTED),
        (Error::DeadlineExceeded("rank 3 never arrived".into()), sys::XLA_FFI_Error_Code_DEADLINE_EXCEEDED),
        (Error::Internal("oops".into()), sys::XLA_FFI_Error_Code_INTERNAL),
        (Error::Interrupted("ctrl-c".into()), sys::XLA_FFI_Error_Code_CANCELLED),
    ];
    for (e, code) in cases {
        assert_eq!(error_code(&e), code);
        let built = Call::default().build();
        let expected = e.to_string();
        assert_eq!(built.handle(move |_| Err(e)), Some((code, expected)));
    }
}

#[test]
fn frame_errors_reach_xla() {
    let built = Call { args: vec![(sys::XLA_FFI_DataType_S32, vec![1])], ..Default::default() }.build();
    let (code, msg) = built.handle(|frame| frame.arg(0, "x").map(drop)).unwrap();
    assert_eq!(code, sys::XLA_FFI_Error_Code_INVALID_ARGUMENT);
    assert!(msg.contains("operand `x` has dtype int32"), "{msg}");
}

#[test]
fn a_panic_becomes_internal() {
    let built = Call::default().build();
    let (code, msg) = built.handle(|_| panic!("boom {}", 42)).unwrap();
    assert_eq!(code, sys::XLA_FFI_Error_Code_INTERNAL);
    assert!(msg.contains("panic in commfuse::xla::tests::a_panic_becomes_internal: boom 42"), "{msg}");
}

#[test]
fn a_short_call_frame_is_an_error() {
    let built = Call::default().build();
    unsafe { (*built.frame).struct_size = std::mem::offset_of!(sys::XLA_FFI_CallFrame, attrs) };
    let (code, msg) = built.handle(|_| Ok(())).unwrap();
    assert_eq!(code, sys::XLA_FFI_Error_Code_INTERNAL);
    assert!(msg.contains("struct_size"), "{msg}");
}

// ---- the CUDA handler without a GPU ----------------------------------------------

#[cfg(feature = "cuda")]
#[test]
fn the_cuda_handler_checks_the_call_then_reports_missing_libraries() {
    use crate::backend::cuda::{handler::collective_matmul, libs::Lib};
    let call = |kind: i64| {
        Call {
            args: vec![f32_arg(&[2, 4]), f32_arg(&[4, 3])],
            rets: vec![f32_arg(&[4, 3]), (sys::XLA_FFI_DataType_U8, vec![1, 4096])],
            attrs: vec![
                ("kind", Attr::I64(kind)),
                ("schedule", Attr::I64(0)),
                ("site", Attr::I64(1)),
                ("dimension", Attr::I64(0)),
                ("mesh_devices", Attr::I64s(vec![2048, i64::from(DEVICE_ORDINAL)])),
                ("mesh_shape", Attr::I64s(vec![2])),
                ("axes", Attr::I64s(vec![0])),
            ],
            ..Default::default()
        }
        .build()
    };
    // Attributes are checked before anything touches CUDA.
    let (code, msg) = call(99).handle(collective_matmul).unwrap();
    assert_eq!(
        (code, msg.as_str()),
        (sys::XLA_FFI_Error_Code_INVALID_ARGUMENT, "commfuse: invalid argument: unknown op kind 99")
    );
    if crate::backend::cuda::api::require(&Lib::ALL).is_ok() {
        return; // A CUDA host: the handler would use the (fake) stream; jax_tests cover it there.
    }
    let built = call(0);
    unsafe { (*built.api).XLA_FFI_Stream_Get = Some(fake_stream) };
    let (code, msg) = built.handle(collective_matmul).unwrap();
    assert_eq!(code, sys::XLA_FFI_Error_Code_UNIMPLEMENTED, "{msg}");
    assert!(msg.contains("cannot load") && msg.contains("COMMFUSE_CUDA_LIBRARY_PATH"), "{msg}");
}

// ---- deferred calls (XLA's FFI future) -------------------------------------

/// What the fake XLA's futures record: `None` while pending, then the
/// outcome (`Ok`, or the error's code and message).
struct FakeFuture {
    outcome: std::sync::Mutex<Option<Result<(), (u32, String)>>>,
}

unsafe extern "C" fn fake_future_create(args: *mut sys::XLA_FFI_Future_Create_Args) -> *mut sys::XLA_FFI_Error {
    let future = Box::into_raw(Box::new(FakeFuture { outcome: std::sync::Mutex::new(None) }));
    unsafe { (*args).future = future as *mut sys::XLA_FFI_Future };
    ptr::null_mut()
}

unsafe extern "C" fn fake_future_available(
    args: *mut sys::XLA_FFI_Future_SetAvailable_Args,
) -> *mut sys::XLA_FFI_Error {
    let future = unsafe { &*((*args).future as *const FakeFuture) };
    let previous = future.outcome.lock().unwrap().replace(Ok(()));
    assert!(previous.is_none(), "a future completed twice");
    ptr::null_mut()
}

unsafe extern "C" fn fake_future_error(args: *mut sys::XLA_FFI_Future_SetError_Args) -> *mut sys::XLA_FFI_Error {
    let future = unsafe { &*((*args).future as *const FakeFuture) };
    let error = take_error(unsafe { (*args).error }).expect("an error");
    let previous = future.outcome.lock().unwrap().replace(Err(error));
    assert!(previous.is_none(), "a future completed twice");
    ptr::null_mut()
}

impl Built {
    fn with_futures(self) -> Built {
        unsafe {
            (*self.api).XLA_FFI_Future_Create = Some(fake_future_create);
            (*self.api).XLA_FFI_Future_SetAvailable = Some(fake_future_available);
            (*self.api).XLA_FFI_Future_SetError = Some(fake_future_error);
        }
        self
    }

    /// The outcome of the future the handler returned through the call frame.
    fn future_outcome(&self) -> Option<Result<(), (u32, String)>> {
        let future = unsafe { (*self.frame).future } as *const FakeFuture;
        assert!(!future.is_null(), "no future in the call frame");
        let future = unsafe { Box::from_raw(future as *mut FakeFuture) };
        let outcome = future.outcome.lock().unwrap().clone();
        outcome
    }
}

fn deferrable_call() -> Built {
    Call {
        args: vec![f32_arg(&[2, 2])],
        rets: vec![f32_arg(&[2]), (sys::XLA_FFI_DataType_U8, vec![0])],
        ..Default::default()
    }
    .build()
    .with_futures()
}

/// Runs a handler on `built` that defers its call, and returns the deferral.
fn defer(built: &Built) -> super::Deferred {
    let mut deferred = None;
    assert_eq!(
        built.handle(|frame| {
            deferred = frame.defer("test op")?;
            Ok(())
        }),
        None
    );
    deferred.expect("this XLA has futures")
}

#[test]
fn a_deferred_call_completes_xlas_future_on_another_thread() {
    let built = deferrable_call();
    let deferred = defer(&built);
    std::thread::spawn(move || {
        deferred.finish(|args, rets| {
            assert_eq!((args.len(), rets.len()), (1, 2));
            assert_eq!((args[0].len(), rets[0].len(), rets[1].len()), (16, 8, 0));
            let sum: u8 = args[0].iter().fold(0u8, |a, &b| a.wrapping_add(b));
            rets[0].fill(sum);
            Ok(())
        })
    })
    .join()
    .unwrap();
    assert_eq!(built.future_outcome(), Some(Ok(())));
    let written = unsafe { std::slice::from_raw_parts((*built.ret_bufs[0]).data as *const u8, 8) };
    let expected: u8 = (0..16).map(|i| (i * 7) as u8).fold(0u8, |a, b| a.wrapping_add(b));
    assert!(written.iter().all(|&b| b == expected));
}

/// What a deferred call runs on its buffers.
type DeferredWork = Box<dyn FnOnce(&[&[u8]], &mut [&mut [u8]]) -> crate::error::Result<()>>;

#[test]
fn a_deferred_calls_error_panic_or_drop_completes_its_future_with_an_error() {
    let run = |work: DeferredWork, finish: bool| {
        let built = deferrable_call();
        let deferred = defer(&built);
        if finish {
            deferred.finish(work);
        } else {
            drop(deferred);
        }
        built.future_outcome().expect("completed")
    };
    let failed = run(Box::new(|_, _| Err(Error::DeadlineExceeded("rank 3 never arrived".into()))), true);
    assert_eq!(
        failed,
        Err((sys::XLA_FFI_Error_Code_DEADLINE_EXCEEDED, "commfuse: deadline exceeded: rank 3 never arrived".into()))
    );
    let panicked = run(Box::new(|_, _| panic!("a bug")), true).unwrap_err();
    assert_eq!(panicked.0, sys::XLA_FFI_Error_Code_INTERNAL);
    assert!(panicked.1.contains("panic in test op"), "{}", panicked.1);
    let dropped = run(Box::new(|_, _| Ok(())), false).unwrap_err();
    assert!(dropped.1.contains("dropped before it ran"), "{}", dropped.1);
}

#[test]
fn without_futures_a_call_is_not_deferred_and_results_handed_out_first_are_refused() {
    let built = Call { rets: vec![f32_arg(&[2])], ..Default::default() }.build();
    let mut frame = built.frame();
    assert!(frame.defer("test op").unwrap().is_none());
    assert!(unsafe { (*built.frame).future }.is_null());

    let built = deferrable_call();
    let mut frame = built.frame();
    frame.take_ret(0, "out").unwrap();
    let Err(e) = frame.defer("test op") else { panic!("deferred after a result was handed out") };
    assert!(e.message().contains("handed out before"), "{e}");
}

// ---- instance state ----------------------------------------------------------

/// Counts its drops, to see XLA's deleter run.
struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn run_stage(
    instance: usize,
    stage: sys::XLA_FFI_ExecutionStage,
    body: impl FnOnce(&mut super::Frame<'_>) -> crate::error::Result<()>,
) -> Option<(u32, String)> {
    let built = Call { stage, instance, ..Default::default() }.build();
    take_error(unsafe { super::handle_stages("test", built.frame, super::Stages::InstantiateAndExecute, body) })
}

#[test]
fn instance_state_made_at_instantiate_reaches_the_instances_calls_and_is_dropped_with_it() {
    let drops = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (instance, other) = (0x5a7e_0001, 0x5a7e_0002);
    let made = Counted(drops.clone());
    let set = run_stage(instance, sys::XLA_FFI_ExecutionStage_INSTANTIATE, |frame| {
        assert_eq!(frame.stage(), super::Stage::Instantiate);
        assert!(frame.instance_state().is_none(), "nothing to read while instantiating");
        frame.set_instance_state(Box::new((made, 41u32)))
    });
    assert_eq!(set, None);
    for _ in 0..2 {
        let read = run_stage(instance, sys::XLA_FFI_ExecutionStage_EXECUTE, |frame| {
            let state = frame.instance_state().expect("the instance's state");
            assert_eq!(state.downcast_ref::<(Counted, u32)>().map(|s| s.1), Some(41));
            Ok(())
        });
        assert_eq!(read, None);
    }
    let elsewhere = run_stage(other, sys::XLA_FFI_ExecutionStage_EXECUTE, |frame| {
        assert!(frame.instance_state().is_none(), "another instance keeps no state");
        Ok(())
    });
    assert_eq!(elsewhere, None);
    assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert_eq!(drop_fake_instance(instance), 1);
    assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), 1, "XLA's deleter drops the state once");
}

#[test]
fn only_a_handler_with_an_instantiate_stage_reads_instance_state() {
    let instance = 0x5a7e_0005;
    assert_eq!(
        run_stage(instance, sys::XLA_FFI_ExecutionStage_INSTANTIATE, |f| f.set_instance_state(Box::new(5u8))),
        None
    );
    // A handler registered without INSTANTIATE (the CUDA target) never asks XLA for state.
    let built = Call { instance, ..Default::default() }.build();
    let err = take_error(unsafe {
        super::handle_stages("test", built.frame, super::Stages::InitializeAndExecute, |frame| {
            assert!(frame.instance_state().is_none());
            Ok(())
        })
    });
    assert_eq!(err, None);
    assert_eq!(drop_fake_instance(instance), 1);
}

#[test]
fn an_api_before_per_stage_state_keeps_none() {
    let built =
        Call { stage: sys::XLA_FFI_ExecutionStage_INSTANTIATE, instance: 0x5a7e_0006, ..Default::default() }.build();
    unsafe { (*built.api).api_version.minor_version = 2 };
    let err = take_error(unsafe {
        super::handle_stages("test", built.frame, super::Stages::InstantiateAndExecute, |frame| {
            let e = frame.set_instance_state(Box::new(6u8)).unwrap_err();
            assert!(e.to_string().contains("predates per-stage state"), "{e}");
            Ok(())
        })
    });
    assert_eq!(err, None);
    assert_eq!(drop_fake_instance(0x5a7e_0006), 0);
}

#[test]
fn instance_state_is_set_at_instantiate_only() {
    let err =
        run_stage(0x5a7e_0003, sys::XLA_FFI_ExecutionStage_EXECUTE, |frame| frame.set_instance_state(Box::new(1u8)));
    let (code, message) = err.expect("refused");
    assert_eq!(code, sys::XLA_FFI_Error_Code_INTERNAL);
    assert!(message.contains("instantiate stage only"), "{message}");
}

#[test]
fn instantiate_runs_the_body_only_where_asked() {
    let ran = |stages, stage| {
        let built = Call { stage, ..Default::default() }.build();
        let mut ran = false;
        let err = take_error(unsafe {
            super::handle_stages("test", built.frame, stages, |_| {
                ran = true;
                Ok(())
            })
        });
        assert_eq!(err, None);
        ran
    };
    use super::Stages::*;
    assert!(ran(InstantiateAndExecute, sys::XLA_FFI_ExecutionStage_INSTANTIATE));
    assert!(ran(InstantiateAndExecute, sys::XLA_FFI_ExecutionStage_EXECUTE));
    assert!(!ran(InstantiateAndExecute, sys::XLA_FFI_ExecutionStage_INITIALIZE));
    assert!(!ran(InstantiateAndExecute, sys::XLA_FFI_ExecutionStage_PREPARE));
    assert!(!ran(InitializeAndExecute, sys::XLA_FFI_ExecutionStage_INSTANTIATE));
}

/// The CPU handler end to end on one rank: INSTANTIATE decodes the site's
/// attributes into the instance's state, and the instance's calls decode
/// their site from it, never through the process's map.
#[test]
fn a_fused_call_decodes_its_site_from_the_instance_state() {
    use crate::call::{sites, SiteAttrs, SiteKey};
    let me = i64::from(DEVICE_ORDINAL);
    let attrs = vec![
        ("kind", Attr::I64(1)), // matmul_reduce_scatter: on one rank, x @ w
        ("schedule", Attr::I64(1)),
        ("site", Attr::I64(-7001)),
        ("dimension", Attr::I64(0)),
        ("mesh_devices", Attr::I64s(vec![me])),
        ("mesh_shape", Attr::I64s(vec![1])),
        ("axes", Attr::I64s(vec![0])),
    ];
    let instance = 0x5a7e_0004;
    let handler = crate::exports::xla::commfuse_collective_matmul_cpu;
    let instantiated =
        Call { attrs: attrs.clone(), stage: sys::XLA_FFI_ExecutionStage_INSTANTIATE, instance, ..Default::default() }
            .build()
            .call(handler);
    assert_eq!(instantiated, None);

    let (m, k, n) = (3usize, 4usize, 2usize);
    let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
    let w: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.91).cos()).collect();
    let workspace = {
        let shapes = crate::abi::CallShapes {
            kind: 1,
            schedule: 1,
            ranks: 1,
            dimension: 0,
            x: vec![m as i64, k as i64],
            w: vec![k as i64, n as i64],
            input: sys::XLA_FFI_DataType_F32,
            output: sys::XLA_FFI_DataType_F32,
        };
        let request =
            crate::prepare::Request { call: shapes, machine: None, gemm_gflops: None, explain: false, trace: None };
        crate::prepare::prepare(&request).expect("prepared").workspace.cpu as i64
    };
    for _ in 0..2 {
        let built = Call {
            args: vec![f32_arg(&[m as i64, k as i64]), f32_arg(&[k as i64, n as i64])],
            rets: vec![f32_arg(&[m as i64, n as i64]), (sys::XLA_FFI_DataType_U8, vec![workspace])],
            attrs: attrs.clone(),
            instance,
            ..Default::default()
        }
        .build();
        unsafe {
            ptr::copy_nonoverlapping(x.as_ptr(), (*built.arg_bufs[0]).data as *mut f32, x.len());
            ptr::copy_nonoverlapping(w.as_ptr(), (*built.arg_bufs[1]).data as *mut f32, w.len());
        }
        assert_eq!(built.call(handler), None);
        let out = unsafe { std::slice::from_raw_parts((*built.ret_bufs[0]).data as *const f32, m * n) };
        for (i, got) in out.iter().enumerate() {
            let want: f32 = (0..k).map(|j| x[i / n * k + j] * w[j * n + i % n]).sum();
            assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "out[{i}] = {got}, want {want}");
        }
    }
    let key = SiteKey {
        attrs: SiteAttrs {
            kind: 1,
            site: -7001,
            schedule: 1,
            dimension: 0,
            mesh_devices: vec![me],
            mesh_shape: vec![1],
            axes: vec![0],
        },
        device: me,
        operands: [
            (vec![m as i64, k as i64], DType::F32),
            (vec![k as i64, n as i64], DType::F32),
            (vec![m as i64, n as i64], DType::F32),
        ],
    };
    assert!(!sites::contains(&key), "the process's map was not used");
    // The instance holds the one device's site.
    let held = run_stage(instance, sys::XLA_FFI_ExecutionStage_EXECUTE, |frame| {
        let state = frame.instance_state().expect("the instance's state");
        assert_eq!(crate::call::instance_sites(state), Some(1));
        Ok(())
    });
    assert_eq!(held, None);
    assert_eq!(drop_fake_instance(instance), 1);
}

// ---- XLA's collectives extension ---------------------------------------------

mod collectives {
    use std::mem::offset_of;
    use std::ptr;

    use super::super::synthetic::*;
    use super::super::{sys, Stage};
    use crate::error::Error;
    use sys::collectives as c;

    /// An API table of FFI API 0.5's layout: 0.3's table, then the lookup
    /// (and the custom options call after it).
    #[repr(C)]
    struct Api05 {
        base: sys::XLA_FFI_Api,
        find_extension: c::XLA_FFI_InvokeContext_FindExtension,
        custom_options: c::XLA_FFI_CustomOptions_Get,
    }
    const _: () =
        assert!(offset_of!(Api05, find_extension) == offset_of!(c::XLA_FFI_Api, XLA_FFI_InvokeContext_FindExtension));

    /// What the fake runtime keeps: the groups asked for, by stage.
    #[derive(Default)]
    struct Record {
        requested: Vec<(i32, Vec<Vec<i64>>, i64)>,
        got: Vec<(i32, Vec<Vec<i64>>, i64)>,
    }

    const COMM: usize = 0xc0ffee0;

    unsafe fn groups_of(groups: *const c::XLA_FFI_ReplicaGroup, n: usize) -> Vec<Vec<i64>> {
        (0..n)
            .map(|i| unsafe {
                let g = &*groups.add(i);
                std::slice::from_raw_parts(g.ids, g.size).to_vec()
            })
            .collect()
    }

    unsafe extern "C" fn fake_request(
        ext: *const c::XLA_FFI_Collectives_Extension,
        args: *mut c::XLA_FFI_Communicator_Request_Args,
    ) -> *mut c::XLA_FFI_Error {
        unsafe {
            let record = &mut *((*ext).state as *mut Record);
            let a = &*args;
            record.requested.push((a.group_mode as i32, groups_of(a.groups, a.num_groups), a.communication_id));
        }
        ptr::null_mut()
    }

    unsafe extern "C" fn fake_get(
        ext: *const c::XLA_FFI_Collectives_Extension,
        args: *mut c::XLA_FFI_Communicator_Get_Args,
    ) -> *mut c::XLA_FFI_Error {
        unsafe {
            let record = &mut *((*ext).state as *mut Record);
            let a = &mut *args;
            record.got.push((a.group_mode as i32, groups_of(a.groups, a.num_groups), a.communication_id));
            a.communicator = COMM as *mut c::XLA_FFI_Communicator;
        }
        ptr::null_mut()
    }

    unsafe extern "C" fn fake_request_window(
        _: *const c::XLA_FFI_Collectives_Extension,
        _: *mut c::XLA_FFI_Window_Request_Args,
    ) -> *mut c::XLA_FFI_Error {
        ptr::null_mut()
    }

    unsafe extern "C" fn fake_get_window(
        _: *const c::XLA_FFI_Collectives_Extension,
        _: *mut c::XLA_FFI_Window_Get_Args,
    ) -> *mut c::XLA_FFI_Error {
        ptr::null_mut()
    }

    /// The fake lookup: the call's context is the extension (or null: none).
    unsafe extern "C" fn fake_find(args: *mut c::XLA_FFI_InvokeContext_FindExtension_Args) -> *mut c::XLA_FFI_Error {
        unsafe {
            let a = &mut *args;
            a.extension = if a.extension_type == c::XLA_FFI_Extension_Collectives as i64 {
                a.ctx as *const c::XLA_FFI_Extension
            } else {
                ptr::null()
            };
        }
        ptr::null_mut()
    }

    /// A lookup that fails (as a runtime may answer for an extension it lacks).
    unsafe extern "C" fn failing_find(_: *mut c::XLA_FFI_InvokeContext_FindExtension_Args) -> *mut c::XLA_FFI_Error {
        let mut args = sys::XLA_FFI_Error_Create_Args {
            struct_size: sys::XLA_FFI_Error_Create_Args_STRUCT_SIZE as usize,
            message: c"no such extension".as_ptr(),
            errc: sys::XLA_FFI_Error_Code_NOT_FOUND,
            ..Default::default()
        };
        unsafe { fake_error_create(&mut args) as *mut c::XLA_FFI_Error }
    }

    /// The extension as a runtime of minor version `minor` attaches it.
    fn extension(record: &mut Record, minor: i32) -> c::XLA_FFI_Collectives_Extension {
        c::XLA_FFI_Collectives_Extension {
            extension_base: c::XLA_FFI_Extension {
                struct_size: c::XLA_FFI_Collectives_Extension_STRUCT_SIZE as usize,
                id: c::XLA_FFI_ExtensionId {
                    extension_type: c::XLA_FFI_Extension_Collectives as i64,
                    major_version: 0,
                    minor_version: minor,
                },
                next: ptr::null(),
            },
            state: record as *mut Record as *mut c::XLA_FFI_CollectivesState,
            request_communicator: Some(fake_request),
            get_communicator: Some(fake_get),
            request_window: Some(fake_request_window),
            get_window: Some(fake_get_window),
        }
    }

    /// A call at `stage` whose API has the lookup `find` (None: a 0.3
    /// table) and whose context is `ext`.
    struct Setup {
        built: Built,
        api: Box<Api05>,
    }

    fn call(
        stage: sys::XLA_FFI_ExecutionStage,
        find: c::XLA_FFI_InvokeContext_FindExtension,
        ext: *mut c::XLA_FFI_Collectives_Extension,
    ) -> Setup {
        let built = Call { stage, ..Default::default() }.build();
        let mut api = Box::new(Api05 { base: fake_api(), find_extension: find, custom_options: None });
        if find.is_some() {
            api.base.struct_size = c::XLA_FFI_Api_STRUCT_SIZE as usize;
        }
        unsafe {
            (*built.frame).api = &api.base as *const sys::XLA_FFI_Api as *mut sys::XLA_FFI_Api;
            (*built.frame).ctx = ext as *mut sys::XLA_FFI_ExecutionContext;
        }
        Setup { built, api }
    }

    fn unusable(setup: &Setup) -> String {
        match setup.built.frame().collectives() {
            Err(Error::Unimplemented(why)) => why,
            other => panic!("expected an unusable extension, got {:?}", other.map(|c| c.map(|c| c.minor_version))),
        }
    }

    const EXECUTE: sys::XLA_FFI_ExecutionStage = sys::XLA_FFI_ExecutionStage_EXECUTE;

    #[test]
    fn none_without_a_lookup_or_an_extension() {
        let mut record = Record::default();
        let mut ext = extension(&mut record, 2);
        // FFI API 0.3: the table ends before the lookup.
        let mut old = call(EXECUTE, Some(fake_find), &mut ext);
        old.api.base.struct_size = sys::XLA_FFI_Api_STRUCT_SIZE as usize;
        assert!(old.built.frame().collectives().unwrap().is_none());
        // A long table whose lookup is unset, one that finds nothing.
        let mut unset = call(EXECUTE, None, &mut ext);
        unset.api.base.struct_size = c::XLA_FFI_Api_STRUCT_SIZE as usize;
        assert!(unset.built.frame().collectives().unwrap().is_none());
        assert!(call(EXECUTE, Some(fake_find), ptr::null_mut()).built.frame().collectives().unwrap().is_none());
    }

    #[test]
    fn a_failed_lookup_is_said_not_taken_for_none() {
        let mut record = Record::default();
        let mut ext = extension(&mut record, 2);
        let why = unusable(&call(EXECUTE, Some(failing_find), &mut ext));
        assert!(why.contains("looking it up failed") && why.contains("no such extension"), "{why}");
    }

    #[test]
    fn found_with_its_version_and_windows_where_they_are() {
        let mut record = Record::default();
        for (minor, windows) in [(1, false), (2, true), (3, true)] {
            let mut ext = extension(&mut record, minor);
            let setup = call(EXECUTE, Some(fake_find), &mut ext);
            let frame = setup.built.frame();
            let found = frame.collectives().unwrap().expect("attached");
            assert_eq!((found.minor_version, found.has_windows), (minor, windows));
        }
        // Minor version 2 in a struct that stops before the windows (or leaves them unset): none.
        let mut ext = extension(&mut record, 2);
        ext.extension_base.struct_size = offset_of!(c::XLA_FFI_Collectives_Extension, request_window);
        let setup = call(EXECUTE, Some(fake_find), &mut ext);
        assert!(!setup.built.frame().collectives().unwrap().unwrap().has_windows);
        let mut ext = extension(&mut record, 2);
        ext.get_window = None;
        let setup = call(EXECUTE, Some(fake_find), &mut ext);
        assert!(!setup.built.frame().collectives().unwrap().unwrap().has_windows);
    }

    #[test]
    fn every_wrong_version_field_and_short_struct_is_named() {
        let mut record = Record::default();
        type Wrong = Box<dyn Fn(&mut c::XLA_FFI_Collectives_Extension)>;
        let cases: Vec<(Wrong, &str)> = vec![
            (Box::new(|e| e.extension_base.id.extension_type = 130), "found one of type 130"),
            (Box::new(|e| e.extension_base.id.major_version = 1), "major version 1"),
            (Box::new(|e| e.extension_base.id.major_version = -1), "major version -1"),
            (Box::new(|e| e.extension_base.id.minor_version = 0), "minor version 0"),
            (Box::new(|e| e.extension_base.struct_size = 8), "shorter than an extension's header"),
            (
                Box::new(|e| {
                    e.extension_base.struct_size = offset_of!(c::XLA_FFI_Collectives_Extension, get_communicator)
                }),
                "stops before the communicator calls",
            ),
            (Box::new(|e| e.request_communicator = None), "request_communicator or get_communicator is not set"),
            (Box::new(|e| e.get_communicator = None), "request_communicator or get_communicator is not set"),
        ];
        for (wrong, said) in cases {
            let mut ext = extension(&mut record, 2);
            wrong(&mut ext);
            let why = unusable(&call(EXECUTE, Some(fake_find), &mut ext));
            assert!(why.contains(said) && why.starts_with("XLA's collectives extension is unusable"), "{why}");
        }
    }

    #[test]
    fn the_communicator_is_requested_at_prepare_and_handed_out_at_initialize_or_execute() {
        let mut record = Record::default();
        let mut ext = extension(&mut record, 1);
        let groups = vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]];

        let prepare = call(sys::XLA_FFI_ExecutionStage_PREPARE, Some(fake_find), &mut ext);
        let frame = prepare.built.frame();
        assert_eq!(frame.stage(), Stage::Prepare);
        let found = frame.collectives().unwrap().unwrap();
        found.request_communicator(&groups, 7).unwrap();
        assert!(matches!(found.communicator(&groups, 7), Err(Error::Internal(m)) if m.contains("not at Prepare")));

        for stage in [sys::XLA_FFI_ExecutionStage_INITIALIZE, EXECUTE] {
            let later = call(stage, Some(fake_find), &mut ext);
            let frame = later.built.frame();
            let found = frame.collectives().unwrap().unwrap();
            assert_eq!(found.communicator(&groups, 7).unwrap() as usize, COMM);
            assert!(matches!(found.request_communicator(&groups, 7), Err(Error::Internal(m)) if m.contains("PREPARE")));
        }
        let flattened = c::XLA_FFI_GROUP_FLATTENED_ID as i32;
        assert_eq!(record.requested, vec![(flattened, groups.clone(), 7)]);
        assert_eq!(record.got, vec![(flattened, groups.clone(), 7), (flattened, groups, 7)]);
    }
}
