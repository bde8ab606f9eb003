//! The host work one fused call spends finding its decoded site, by the two
//! ways `call::Call::decode` has: through the process's map (its attributes
//! read by name and hashed on every call, where XLA keeps no instance
//! state) and through XLA's instance state (decoded once at INSTANTIATE).
//! On synthetic call frames (`xla::synthetic`): no XLA, no transport.
//!
//! `cargo run --release --example site_decode [calls]`; prints ns per call
//! and their ratio, from one run.

use commfuse::call::{self, Call};
use commfuse::dtype::DType;
use commfuse::xla::synthetic::{Attr, Call as FrameCall, DEVICE_ORDINAL};
use commfuse::xla::{self, sys, Stages};
use std::time::Instant;

fn main() {
    let calls: usize = std::env::args().nth(1).map_or(200_000, |n| n.parse().expect("calls: a count"));
    let me = i64::from(DEVICE_ORDINAL);
    // An 8-device mesh of two axes, the op over one (a 2 x 4 data x tensor mesh).
    let devices: Vec<i64> = (0..8).map(|d| if d == 1 { me } else { 4000 + d }).collect();
    let attrs = vec![
        ("kind", Attr::I64(0)),
        ("schedule", Attr::I64(1)),
        ("site", Attr::I64(9001)),
        ("dimension", Attr::I64(0)),
        ("mesh_devices", Attr::I64s(devices)),
        ("mesh_shape", Attr::I64s(vec![2, 4])),
        ("axes", Attr::I64s(vec![1])),
    ];
    let (x, w, out) = ([256i64, 1024], [1024i64, 512], [1024i64, 512]);
    let f32s = |dims: &[i64]| (sys::XLA_FFI_DataType_F32, dims.to_vec());
    let frame_of = |instance| FrameCall {
        args: vec![f32s(&x), f32s(&w)],
        rets: vec![f32s(&out)],
        attrs: attrs.clone(),
        instance,
        ..Default::default()
    };
    let operands = [(&x[..], DType::F32), (&w[..], DType::F32), (&out[..], DType::F32)];

    let instance = 0x51de;
    let instantiate = FrameCall {
        attrs: attrs.clone(),
        stage: sys::XLA_FFI_ExecutionStage_INSTANTIATE,
        instance,
        ..Default::default()
    }
    .build();
    // SAFETY: a synthetic frame, every pointer in its arena.
    let err = unsafe {
        xla::handle_stages("instantiate", instantiate.frame, Stages::InstantiateAndExecute, |f| call::instantiate(f))
    };
    assert!(err.is_null(), "instantiate failed");

    let time = |instance| {
        let built = frame_of(instance).build();
        let frame = built.frame();
        let site = Call::decode(&frame, operands, me).expect("decodes").decoded.site;
        let start = Instant::now();
        for _ in 0..calls {
            std::hint::black_box(Call::decode(&frame, operands, me).expect("decodes"));
        }
        (start.elapsed().as_nanos() as f64 / calls as f64, site)
    };
    let (map_ns, _) = time(0);
    let (instance_ns, _) = time(instance);
    let [instances, from_instances, from_map] = call::counts::now();
    assert_eq!((instances, from_instances, from_map), (1, 1, 1), "each way decoded its site once");
    println!("{calls} calls of a fused op's site lookup (8-device mesh, group of 4):");
    println!("  process map (attributes decoded per call): {map_ns:8.1} ns/call");
    println!("  XLA instance state (decoded at instantiate): {instance_ns:8.1} ns/call");
    println!("  ratio map / instance: {:.2}x", map_ns / instance_ns);
}
