//! Expert-parallel algorithms of uep: the DeepEP programming model on any transport.
//!
//! * [`layout`]: `get_dispatch_layout`, which ranks and experts each token goes to.
//! * [`quant`]: the FP8 e4m3 per-128-channel quantiser and bf16 helpers (SPEC.md §5).
//! * [`reference`]: a plain, sequential model of every data path; the oracle of all tests.
//! * [`Buffer`]: owns the registered (symmetric) memory and runs normal and
//!   low-latency dispatch/combine on the host device.

pub mod buffer;
pub mod device;
pub mod error;
pub mod layout;
pub mod ll;
pub mod net;
pub mod normal;
pub mod quant;
pub mod reference;
pub mod symm;
pub mod workload;

pub use buffer::{Buffer, BufferConfig, RecvTokens, Tokens};
pub use error::{EpError, Result};
pub use layout::{get_dispatch_layout, DispatchLayout};
pub use ll::{LlDispatchOutput, LlHandle};
pub use net::NetConfig;
pub use normal::{CombineOutput, DispatchArgs, DispatchOutput, NormalHandle};
