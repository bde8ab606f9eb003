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
