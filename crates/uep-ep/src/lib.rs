//! Expert-parallel algorithms of uep: the DeepEP programming model on any transport.
//!
//! One [`Buffer`] per rank owns registered memory that the ranks of a node map into
//! each other ([`symm`]), laid out the same on every rank as typed areas ([`area`],
//! [`map`]). Its calls are those of DeepEP:
//!
//! * [`layout`]: `get_dispatch_layout`, which ranks and experts each token goes to;
//! * [`normal`]: high-throughput dispatch and combine (notify → plan → pack → publish →
//!   relay → finish), across nodes through a relay rank per node;
//! * [`ll`]: low-latency dispatch and combine with fixed layouts, FP8 on the way, and a
//!   receive half that can be deferred;
//! * [`quant`]: the FP8 e4m3 per-128-channel quantiser and the f32 reductions.
//!
//! Peers on the same node are written directly; peers on other nodes through the
//! network path ([`net`]): packets posted as one-sided writes by the CPU proxy, whose
//! receiving side says when they have landed (in order for normal mode, per expert for
//! low-latency calls). Every wait goes through one primitive ([`wait`]) that also
//! watches for aborts, dead peers and a failed proxy, and every call fails the job for
//! every rank at once rather than leaving one waiting. `docs/architecture.md` tells the
//! whole story.
#![deny(unsafe_code)]

pub mod area;
pub mod buffer;
pub mod config;
mod ctx;
pub mod device;
pub mod elastic;
pub mod error;
pub mod layout;
pub mod liveness;
pub mod ll;
pub mod map;
mod mask;
pub mod net;
pub mod normal;
pub mod packet;
pub mod quant;
pub mod symm;
pub mod tokens;
pub mod topology;
pub mod wait;

pub use buffer::Buffer;
pub use config::{
    ranks_per_node_from_env, timeout_from_env, BufferConfig, Connect, Shape, DEFAULT_TIMEOUT,
};
pub use error::{EpError, ErrorKind, Result};
pub use layout::{get_dispatch_layout, DispatchLayout};
pub use ll::{LlCombineInput, LlCombinePending, LlDispatchOutput, LlHandle, LlPending};
pub use net::NetConfig;
pub use normal::{CombineArgs, CombineOutput, DispatchArgs, DispatchOutput, NormalHandle};
pub use symm::Lease;
pub use tokens::{RecvTokens, Tokens};
pub use topology::Topology;
