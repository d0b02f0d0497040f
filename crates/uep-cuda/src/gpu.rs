//! One CUDA device through the driver API: its context, a stream, and the kernels
//! `build.rs` compiled into this crate.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::{CudaError, DeviceInfo};

/// The fat binaries `build.rs` made (sm_90 and sm_80 machine code).
pub(crate) mod kernels {
    pub(crate) const FIFO_BENCH: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/fifo_bench.fatbin"));
    pub(crate) const CAST: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/cast.fatbin"));
    pub(crate) const LAYOUT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/layout.fatbin"));
    pub(crate) const REDUCE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/reduce.fatbin"));
    pub(crate) const LL_SEND: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ll_send.fatbin"));
    pub(crate) const SELFTEST: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/selftest.fatbin"));
}

/// Maps a driver error to [`CudaError::Driver`] naming what was being done.
pub(crate) fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |e| CudaError::Driver {
        what,
        detail: e.to_string(),
    }
}

/// A CUDA device opened for uep's kernels (a clone shares its context and stream).
#[derive(Clone, Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl Gpu {
    /// Opens device `ordinal`: fails with [`CudaError::NoDriver`] where no driver
    /// library loads, [`CudaError::NoDevice`] where it sees no such device.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        // SAFETY: only tries to dlopen the driver library under its known names.
        #[allow(unsafe_code)]
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        if !present {
            return Err(CudaError::NoDriver);
        }
        let count = CudaContext::device_count().map_err(driver("counting devices"))?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("creating a context"))?;
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        Ok(Gpu { ctx, stream })
    }

    /// Name, compute capability, multiprocessors and memory.
    pub fn info(&self) -> Result<DeviceInfo, CudaError> {
        let sms = self
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("reading the multiprocessor count"))?;
        Ok(DeviceInfo {
            name: self.ctx.name().map_err(driver("reading the device name"))?,
            capability: self
                .ctx
                .compute_capability()
                .map_err(driver("reading the compute capability"))?,
            sms: sms.max(1) as u32,
            memory: self
                .ctx
                .total_mem()
                .map_err(driver("reading the memory size"))?,
        })
    }

    /// The device's context.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream uep's kernels run on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The median time of `iters` runs of `launch` (device events around each).
    pub(crate) fn time(
        &self,
        iters: usize,
        mut launch: impl FnMut() -> Result<(), CudaError>,
    ) -> Result<Duration, CudaError> {
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t0 = self
                .stream
                .record_event(timing)
                .map_err(driver("recording an event"))?;
            launch()?;
            let t1 = self
                .stream
                .record_event(timing)
                .map_err(driver("recording an event"))?;
            t1.synchronize().map_err(driver("running a timed kernel"))?;
            let ms = t0.elapsed_ms(&t1).map_err(driver("reading an event"))?;
            times.push(Duration::from_secs_f64(f64::from(ms) / 1e3));
        }
        times.sort();
        Ok(times.get(times.len() / 2).copied().unwrap_or_default())
    }

    /// The device address of `s`, as a kernel argument (`crate::api`).
    pub(crate) fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        // Every kernel runs on this one stream, so the slice's use needs no event.
        let (ptr, _same_stream) = s.device_ptr(&self.stream);
        ptr
    }

    /// Launches `f` over `cfg` with its one argument struct (`kernels/api.cuh`).
    ///
    /// # Safety
    ///
    /// `A` is the struct `f` takes, and every address in `args` is device memory (or
    /// mapped host memory) valid for all the kernel reads and writes there until the
    /// stream reaches the launch's end.
    #[allow(unsafe_code)]
    pub(crate) unsafe fn launch<A: DeviceRepr>(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &A,
        what: &'static str,
    ) -> Result<(), CudaError> {
        let mut l = self.stream.launch_builder(f);
        l.arg(args);
        // SAFETY: the caller's promise.
        unsafe { l.launch(cfg) }.map_err(driver(what))?;
        Ok(())
    }

    /// Kernel `name` of an embedded fat binary.
    pub(crate) fn function(&self, fatbin: &[u8], name: &str) -> Result<CudaFunction, CudaError> {
        let module = self
            .ctx
            .load_module(Ptx::from_binary(fatbin.to_vec()))
            .map_err(driver("loading uep's kernels (built for sm_90 and sm_80)"))?;
        module
            .load_function(name)
            .map_err(driver("finding a kernel in uep's module"))
    }
}
