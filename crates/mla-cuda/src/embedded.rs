//! The kernels build.rs compiled into this binary.

/// One `kernels/<name>.cu` file: machine code for Hopper and PTX for anything from Ampere on.
pub struct EmbeddedModule {
    pub name: &'static str,
    pub cubin_sm90a: &'static [u8],
    pub ptx: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
