//! One GPU as the backend uses it: the adapter picked, its device and queue, the kernels
//! compiled for it, the commands recorded since the last read, and the first error it
//! reported. Operations record into one command encoder; a read submits it and waits, so a
//! forward reaches the device as one submission.

use crate::EngineError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// What names an adapter: a forward's bits are the same on the same adapter and driver only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterIdentity {
    pub name: String,
    pub vendor: u32,
    pub device: u32,
    pub driver: String,
    pub driver_info: String,
    /// A software rasterizer (lavapipe): never picked by `--device auto`.
    pub software: bool,
}

impl AdapterIdentity {
    fn of(info: &wgpu::AdapterInfo) -> AdapterIdentity {
        AdapterIdentity {
            name: info.name.clone(),
            vendor: info.vendor,
            device: info.device,
            driver: info.driver.clone(),
            driver_info: info.driver_info.clone(),
            software: info.device_type == wgpu::DeviceType::Cpu,
        }
    }

    /// A 32-bit FNV-1a digest of the identity: the adapter's part of the engine id.
    pub fn digest(&self) -> u32 {
        let text = format!("{}|{}|{}|{}|{}", self.name, self.vendor, self.device, self.driver, self.driver_info);
        text.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193))
    }
}

impl std::fmt::Display for AdapterIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (vendor {:#x}, device {:#x}, {} {})", self.name, self.vendor, self.device, self.driver, self.driver_info)?;
        if self.software {
            f.write_str(", software")?;
        }
        Ok(())
    }
}

/// Device-local memory, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The adapter's device-local heaps.
    pub total: u64,
    /// What this process holds there (its allocator's blocks: weights, KV caches, scratch).
    pub used: u64,
    /// What this process may still take: the driver's budget less everything's usage where it
    /// reports them (`VK_EXT_memory_budget`), else the heaps less what this process holds.
    pub free: u64,
}

/// Adapter `index`'s device memory as this process sees it (opening its device, once per
/// process); None where the platform does not say.
pub fn adapter_memory(index: usize) -> Result<Option<DeviceMemory>, EngineError> {
    Ok(Ctx::open(index)?.memory())
}

fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::PRIMARY,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    })
}

/// The compute adapters of this machine, in the order `gpu:N` counts them (listed once per
/// process).
pub fn adapters() -> Vec<AdapterIdentity> {
    static LISTED: std::sync::OnceLock<Vec<AdapterIdentity>> = std::sync::OnceLock::new();
    LISTED.get_or_init(|| compute_adapters(&instance()).iter().map(|a| AdapterIdentity::of(&a.get_info())).collect()).clone()
}

fn compute_adapters(inst: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    pollster::block_on(inst.enumerate_adapters(wgpu::Backends::PRIMARY))
        .into_iter()
        .filter(|a| a.get_downlevel_capabilities().flags.contains(wgpu::DownlevelFlags::COMPUTE_SHADERS))
        .collect()
}

/// One adapter's device, shared by every stage a process opens on it.
pub(crate) struct Ctx {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub identity: AdapterIdentity,
    pub limits: wgpu::Limits,
    kernels: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    pending: Mutex<Option<wgpu::CommandEncoder>>,
    /// The first error the device reported (validation, out of memory, lost), kept until read.
    error: Arc<Mutex<Option<String>>>,
}

/// Words of every kernel's parameters (`Params` in common.wgsl).
const PARAMS: usize = 12;

/// The devices this process opened, by adapter index: kept open (with their compiled kernels)
/// for the process's life, since stages come and go.
static OPEN: Mutex<Vec<(usize, Arc<Ctx>)>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ctx {
    /// Adapter `index`'s device, opened once per process.
    pub fn open(index: usize) -> Result<Arc<Ctx>, EngineError> {
        let mut open = lock(&OPEN);
        if let Some((_, ctx)) = open.iter().find(|(i, _)| *i == index) {
            return Ok(ctx.clone());
        }
        let inst = instance();
        let mut found = compute_adapters(&inst);
        if found.is_empty() {
            return Err(EngineError::Device("no GPU adapter found (no Vulkan, Metal or DX12 device with compute shaders)".into()));
        }
        if index >= found.len() {
            return Err(EngineError::Device(format!("no GPU adapter {index}: this machine has {}", found.len())));
        }
        let adapter = found.swap_remove(index);
        let limits = adapter.limits();
        let desc = wgpu::DeviceDescriptor {
            label: Some("dgr"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        };
        let (device, queue) =
            pollster::block_on(adapter.request_device(&desc)).map_err(|e| EngineError::Device(format!("opening the GPU: {e}")))?;
        let error = Arc::new(Mutex::new(None));
        let slot = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            lock(&slot).get_or_insert_with(|| e.to_string());
        }));
        let slot = error.clone();
        device.set_device_lost_callback(move |reason, msg| {
            lock(&slot).get_or_insert_with(|| format!("device lost ({reason:?}): {msg}"));
        });
        let ctx = Arc::new(Ctx {
            device,
            queue,
            identity: AdapterIdentity::of(&adapter.get_info()),
            limits,
            kernels: Mutex::new(HashMap::new()),
            pending: Mutex::new(None),
            error,
        });
        open.push((index, ctx.clone()));
        Ok(ctx)
    }

    /// The device's memory, where the backend says (Vulkan); None elsewhere.
    pub fn memory(&self) -> Option<DeviceMemory> {
        use ash::vk;
        let used = self.device.generate_allocator_report().map_or(0, |r| r.total_reserved_bytes);
        // SAFETY: the Vulkan device is only read from (its physical device's memory properties,
        // through the instance it was made from); no handle is destroyed or kept past this call.
        let hal = unsafe { self.device.as_hal::<wgpu::hal::api::Vulkan>() }?;
        let instance = hal.shared_instance();
        let physical = hal.raw_physical_device();
        // The budget's structure may be chained only where its extension is on, and the call
        // taking it is core from Vulkan 1.1.
        let budgeted = instance.instance_api_version() >= vk::API_VERSION_1_1
            && hal.enabled_device_extensions().contains(&ash::ext::memory_budget::NAME);
        let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
        let props = if budgeted {
            let mut props = vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
            // SAFETY: as above; `props` chains only the budget, whose extension is enabled.
            unsafe { instance.raw_instance().get_physical_device_memory_properties2(physical, &mut props) };
            props.memory_properties
        } else {
            // SAFETY: as above.
            unsafe { instance.raw_instance().get_physical_device_memory_properties(physical) }
        };
        let heaps = props.memory_heap_count.min(vk::MAX_MEMORY_HEAPS as u32) as usize;
        let local: Vec<usize> = (0..heaps).filter(|&i| props.memory_heaps[i].flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL)).collect();
        let total = local.iter().map(|&i| props.memory_heaps[i].size).sum();
        let free = match budgeted {
            true => local.iter().map(|&i| budget.heap_budget[i].saturating_sub(budget.heap_usage[i])).sum(),
            false => u64::saturating_sub(total, used),
        };
        Some(DeviceMemory { total, used, free })
    }

    /// The most bytes one binding may span.
    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size)
    }

    /// Kernel `name`, compiled from `source` the first time it is asked for.
    pub fn kernel(&self, name: &str, source: impl FnOnce() -> String) -> Arc<wgpu::ComputePipeline> {
        let mut kernels = lock(&self.kernels);
        if let Some(k) = kernels.get(name) {
            return k.clone();
        }
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor { label: Some(name), source: wgpu::ShaderSource::Wgsl(source().into()) });
        let pipeline = Arc::new(self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(name),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        }));
        kernels.insert(name.to_string(), pipeline.clone());
        pipeline
    }

    /// A zeroed storage buffer of `bytes` (at least 4).
    pub fn buffer(&self, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: bytes.max(4).next_multiple_of(4),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A storage buffer holding `bytes` (padded with zeros to a whole word).
    pub fn buffer_with(&self, bytes: &[u8]) -> wgpu::Buffer {
        self.buffer_init(bytes, wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST)
    }

    /// A buffer of `usage` holding `bytes`, padded with zeros to a whole word (at least one).
    /// Not wgpu's `create_buffer_init`, which panics where the device is lost: here the copy
    /// is skipped, and the loss is the error the next read returns (`check`).
    fn buffer_init(&self, bytes: &[u8], usage: wgpu::BufferUsages) -> wgpu::Buffer {
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: (bytes.len() as u64).max(4).next_multiple_of(4),
            usage,
            mapped_at_creation: true,
        });
        if let Ok(mut view) = buffer.get_mapped_range_mut(..) {
            view.slice(..bytes.len()).copy_from_slice(bytes);
        }
        buffer.unmap();
        buffer
    }

    /// Runs `f` on the encoder of the commands recorded since the last submission.
    pub fn record(&self, f: impl FnOnce(&mut wgpu::CommandEncoder)) {
        let mut pending = lock(&self.pending);
        let enc = pending.get_or_insert_with(|| self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }));
        f(enc)
    }

    /// Records one dispatch of `kernel` over `groups` workgroups, with the parameter words (at
    /// most twelve, the rest zero) and
    /// the storage bindings (1, 2, ... in order; each a buffer and a byte range).
    pub fn dispatch(&self, kernel: &wgpu::ComputePipeline, params: &[u32], bindings: &[(&wgpu::Buffer, u64, u64)], groups: [u32; 3]) {
        if groups.contains(&0) {
            return;
        }
        let mut words: Vec<u8> = params.iter().flat_map(|w| w.to_le_bytes()).collect();
        words.resize(4 * PARAMS, 0);
        let uniform = self.buffer_init(&words, wgpu::BufferUsages::UNIFORM);
        let mut entries = vec![wgpu::BindGroupEntry { binding: 0, resource: uniform.as_entire_binding() }];
        for (i, &(buf, offset, size)) in bindings.iter().enumerate() {
            let size = std::num::NonZeroU64::new(size.max(4));
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer: buf, offset, size }),
            });
        }
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &kernel.get_bind_group_layout(0),
            entries: &entries,
        });
        self.record(|enc| {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            pass.set_pipeline(kernel);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        });
    }

    /// Submits what was recorded, then copies `bytes` of `buf` from `offset` back (both whole
    /// words) once the device has run it all.
    pub fn read(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>, EngineError> {
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: bytes.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if bytes > 0 {
            self.record(|enc| enc.copy_buffer_to_buffer(buf, offset, &staging, 0, bytes));
        }
        self.flush();
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let polled = self.device.poll(wgpu::PollType::wait_indefinitely());
        self.check()?;
        polled.map_err(|e| EngineError::Device(format!("waiting for the GPU: {e}")))?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(EngineError::Device(format!("reading back from the GPU: {e}"))),
            Err(_) => return Err(EngineError::Device("the GPU never answered a read".into())),
        }
        let view = slice.get_mapped_range().map_err(|e| EngineError::Device(format!("reading back from the GPU: {e}")))?;
        let out = view[..bytes as usize].to_vec();
        drop(view);
        staging.unmap();
        Ok(out)
    }

    /// Submits the recorded commands.
    pub fn flush(&self) {
        if let Some(enc) = lock(&self.pending).take() {
            self.queue.submit([enc.finish()]);
        }
    }

    /// The first error the device reported, as a typed error.
    pub fn check(&self) -> Result<(), EngineError> {
        match lock(&self.error).clone() {
            Some(e) => Err(EngineError::Device(e)),
            None => Ok(()),
        }
    }
}
