//! Raw bindings to XLA's FFI C API (`xla/ffi/api/c_api.h`, API version 0.3).
//!
//! `bindings.rs` is bindgen output committed to the repository, so building
//! this crate needs neither libclang nor the jaxlib headers. `regenerate.sh`
//! rebuilds it from the header of the installed jaxlib.
//!
//! C enums are plain integer constants (bindgen's "consts" style): XLA may pass
//! values a Rust `enum` would not know, which would be undefined behaviour.
//! Every struct carries a `struct_size` (see the `*_STRUCT_SIZE` constants);
//! callers check it before reading fields a shorter struct may lack.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
#![allow(clippy::all)]
#![allow(rustdoc::all)]

include!("bindings.rs");

/// XLA's collectives extension (`xla/ffi/api/collectives_c_api.h`, jaxlib
/// 0.11.2 and later: version 0.1, and 0.2 with symmetric-memory windows),
/// generated from a newer jaxlib's headers than the bindings above. With it
/// comes that FFI API's table (`XLA_FFI_Api` of API 0.5): its fields past the
/// end of 0.3's table, `XLA_FFI_InvokeContext_FindExtension` among them, are
/// read from a table only where its `struct_size` covers them. Its types
/// that 0.3 also has are those of the newer header (some renamed there).
pub mod collectives {
    include!("collectives.rs");
}
