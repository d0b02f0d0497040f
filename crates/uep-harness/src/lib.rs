//! uep's verification harness: what every test and benchmark checks uep against.
//!
//! * [`workload`]: deterministic inputs (every rank can regenerate every rank's input);
//! * [`reference`](mod@reference): the sequential model of every data path, the oracle of all tests;
//! * [`case`]: one step's inputs with the outputs the reference expects;
//! * [`check`]: the bit-for-bit comparator that names the first mismatch;
//! * [`step`]: one verified step of each mode (dispatch, identity expert, combine);
//! * [`npy`]: `.npy` files, for checking uep with numpy;
//! * [`ranks`]: several ranks in one process, over the real rendezvous;
//! * [`limits`]: what the machine can do at best (memory copies), for the benchmarks;
//! * [`netns`]: hosts on one machine (network namespaces), for multi-node tests.
//!
//! The CLI (`uep bench`), uep-ep's tests and the Python package's tests all use it.
#![deny(unsafe_code)]

pub mod case;
pub mod check;
pub mod limits;
pub mod netns;
pub mod npy;
pub mod ranks;
pub mod reference;
pub mod step;
pub mod workload;
