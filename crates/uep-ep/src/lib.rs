//! Expert-parallel algorithms of uep: the DeepEP programming model on any transport.
//!
//! One [`Buffer`] per rank owns registered memory that the ranks of a node map into
//! each other (`symm`), laid out the same on every rank as typed areas (`area`,
//! `map`). Its calls are those of DeepEP:
//!
//! * `get_dispatch_layout` ([`get_dispatch_layout`]), which ranks and experts each token
//!   goes to;
//! * normal dispatch and combine ([`Buffer::dispatch`], [`Buffer::combine`]: notify →
//!   plan → pack → publish → relay → finish), across nodes through a relay rank per
//!   node;
//! * low-latency dispatch and combine ([`Buffer::low_latency_dispatch`],
//!   [`Buffer::low_latency_combine`]) with fixed layouts, FP8 on the way, and a receive
//!   half that can be deferred;
//! * [`quant`]: the FP8 e4m3 per-128-channel quantiser and the f32 reductions.
//!
//! Kernels run on a [`device`] ([`device::HostDevice`]: CPU threads) and push the
//! commands for peers on other nodes themselves. Peers on the same node are written
//! directly; peers on other nodes through the network path (`net`): packets posted as
//! one-sided writes by the CPU proxy, whose receiving side says when they have landed
//! (in order for normal mode, per expert for low-latency calls). Every wait goes
//! through one primitive (`wait`) that also
//! watches for aborts, dead peers and a failed proxy, and every call fails the job for
//! every rank at once rather than leaving one waiting. `docs/architecture.md` tells the
//! whole story.
#![deny(unsafe_code)]

// The layers, imports pointing down this list (`docs/architecture.md`, "uep-ep"):
// areas and layouts; the runtime (memory, waits, liveness, errors, the device); the
// network path; the context of a call; the operations; the Buffer.
mod agree;
mod area;
mod config;
mod error;
pub mod exchange;
mod fnv;
mod layout;
mod packet;
mod topology;

mod door;
mod liveness;
mod map;
mod mask;
mod symm;
mod tokens;
mod wait;

pub mod device;
pub mod quant;

mod net;

mod ctx;

mod elastic;
mod ll;
mod normal;

mod buffer;

pub use area::Area;
pub use buffer::Buffer;
pub use config::{
    ranks_per_node_from_env, timeout_from_env, BufferConfig, Connect, JobStore, Shape,
    DEFAULT_TIMEOUT,
};
pub use door::{door_name, remove_stale_doors, FirstCall, JoinPoint};
pub use error::{EpError, ErrorKind, Gone, Lost, Result};
pub use layout::{get_dispatch_layout, DispatchLayout};
pub use liveness::LivenessConfig;
pub use ll::{
    LlCombineInput, LlCombinePending, LlDispatchArgs, LlDispatchOutput, LlHandle, LlPending,
};
pub use net::{NetConfig, DEFAULT_WRITE_BYTES};
pub use normal::{
    CombineArgs, CombineOutput, DispatchArgs, DispatchOutput, NormalHandle, WeightLanes,
};
pub use quant::Cast;
pub use symm::Lease;
pub use tokens::{RecvTokens, TokenFormat, Tokens};
pub use topology::{Topology, MAX_RANKS_PER_NODE};
pub use wait::set_spin_only;
