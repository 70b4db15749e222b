//! The real GPU probe: NVML (`libnvidia-ml.so.1`) opened at run time. Each function is looked
//! up by name when it is used, so a driver without it makes that one answer
//! [`Unavailable::MissingSymbol`]. The optional load for PCIe sampling goes through the CUDA
//! driver (`libcuda.so.1`), also opened at run time.
//!
//! Signatures follow nvml.h and cuda.h; each call site states the one it uses.

use super::*;
use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

type NvmlReturn = c_int;
/// `nvmlDevice_t`: an opaque pointer, kept as an address so the probe stays `Send`.
type DeviceHandle = usize;

const NVML_SUCCESS: NvmlReturn = 0;
const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
const NVML_ERROR_NO_PERMISSION: NvmlReturn = 4;
const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;

/// nvml.h: `NVML_NVLINK_MAX_LINKS` (18 since Hopper).
const NVLINK_MAX_LINKS: u32 = 18;
const NVML_TEMPERATURE_GPU: c_int = 0;
const NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: c_int = 1;
const NVML_MEMORY_ERROR_TYPE_CORRECTED: c_int = 0;
const NVML_MEMORY_ERROR_TYPE_UNCORRECTED: c_int = 1;
/// nvml.h `nvmlClockType_t`.
const NVML_CLOCK_SM: c_int = 1;
const NVML_CLOCK_MEM: c_int = 2;
/// nvml.h `nvmlEventTypeXidCriticalError`.
const NVML_EVENT_TYPE_XID_CRITICAL_ERROR: c_ulonglong = 0x8;
/// Events taken from the set per reading, so a storm cannot hold a scrape.
const XID_EVENTS_PER_READING: usize = 256;
const NVML_VOLATILE_ECC: c_int = 0;
const NVML_AGGREGATE_ECC: c_int = 1;
const NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT: c_int = 0;
const NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT: c_int = 1;

/// nvml.h `nvmlPciInfo_t` as `nvmlDeviceGetPciInfo_v3` fills it.
#[repr(C)]
struct NvmlPciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

/// nvml.h `nvmlMemory_t` (v1).
#[repr(C)]
struct NvmlMemory {
    total: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

/// nvml.h `nvmlUtilization_t`.
#[repr(C)]
struct NvmlUtilization {
    gpu: c_uint,
    memory: c_uint,
}

/// nvml.h `nvmlEventData_t`.
#[repr(C)]
struct NvmlEventData {
    device: *mut c_void,
    event_type: c_ulonglong,
    event_data: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// The event set the XID count is drained from, created at the first reading.
#[derive(Default)]
struct XidEvents {
    /// `nvmlEventSet_t` as an address; 0 until created.
    set: usize,
    /// Why there is none (the driver cannot deliver XID events to us).
    unavailable: Option<Unavailable>,
    /// Devices registered on the set, by handle.
    registered: Vec<DeviceHandle>,
    counts: std::collections::HashMap<DeviceHandle, u64>,
}

/// Why NVML could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum NvmlLoadError {
    #[error("libnvidia-ml.so.1 not loadable ({0})")]
    Library(String),
    #[error("nvmlInit failed: {0}")]
    Init(String),
}

/// NVML, initialised. Shut down on drop.
pub struct Nvml {
    lib: Library,
    version: String,
    /// nvmlShutdown balances a successful nvmlInit only.
    initialised: bool,
    xid: std::sync::Mutex<XidEvents>,
}

impl Nvml {
    pub fn load() -> Result<Nvml, NvmlLoadError> {
        // SAFETY: opening the vendor's management library runs its initialisers, which have no
        // preconditions on our side.
        let lib = unsafe { Library::new("libnvidia-ml.so.1") }
            .map_err(|e| NvmlLoadError::Library(error_chain(&e)))?;
        let mut nvml = Nvml {
            lib,
            version: String::new(),
            initialised: false,
            xid: std::sync::Mutex::new(XidEvents::default()),
        };
        let init = nvml
            .function::<unsafe extern "C" fn() -> NvmlReturn>("nvmlInit_v2")
            .or_else(|_| nvml.function::<unsafe extern "C" fn() -> NvmlReturn>("nvmlInit"))
            .map_err(|e| NvmlLoadError::Init(e.to_string()))?;
        // SAFETY: nvml.h `nvmlReturn_t nvmlInit_v2(void)`.
        let rc = unsafe { init() };
        if rc != NVML_SUCCESS {
            return Err(NvmlLoadError::Init(nvml.error_string(rc)));
        }
        nvml.initialised = true;
        nvml.version = nvml
            .string_query("nvmlSystemGetNVMLVersion", 80)
            .unwrap_or_default();
        Ok(nvml)
    }

    /// The function `name`, typed as `F`.
    fn function<F: Copy>(&self, name: &'static str) -> Probed<F> {
        // SAFETY: every caller names `F` as the C signature nvml.h (or cuda.h) gives `name`; the
        // pointer is only called while `self.lib` is loaded, which it is for `self`'s life.
        unsafe { self.lib.get::<F>(name) }
            .map(|symbol| *symbol)
            .map_err(|_| Unavailable::MissingSymbol(name.to_string()))
    }

    fn error_string(&self, rc: NvmlReturn) -> String {
        let named = match rc {
            NVML_ERROR_NO_PERMISSION => Some("no permission"),
            NVML_ERROR_NOT_SUPPORTED => Some("not supported"),
            _ => None,
        };
        if let Some(n) = named {
            return n.to_string();
        }
        match self.function::<unsafe extern "C" fn(NvmlReturn) -> *const c_char>("nvmlErrorString")
        {
            Ok(f) => {
                // SAFETY: nvml.h `const char* nvmlErrorString(nvmlReturn_t)` returns a static,
                // NUL-terminated string (or null).
                let ptr = unsafe { f(rc) };
                if ptr.is_null() {
                    format!("NVML error {rc}")
                } else {
                    // SAFETY: non-null and NUL-terminated per nvml.h; copied at once.
                    let text = unsafe { std::ffi::CStr::from_ptr(ptr) };
                    format!("{} (NVML error {rc})", text.to_string_lossy())
                }
            }
            Err(_) => format!("NVML error {rc}"),
        }
    }

    fn status(&self, rc: NvmlReturn, name: &'static str) -> Probed<()> {
        match rc {
            NVML_SUCCESS => Ok(()),
            NVML_ERROR_NOT_SUPPORTED => Err(Unavailable::NotSupported),
            NVML_ERROR_FUNCTION_NOT_FOUND => Err(Unavailable::MissingSymbol(name.to_string())),
            _ => Err(Unavailable::Failed(format!(
                "{name}: {}",
                self.error_string(rc)
            ))),
        }
    }

    /// `nvmlReturn_t f(char *buf, unsigned int length)`.
    fn string_query(&self, name: &'static str, len: usize) -> Probed<String> {
        let f = self.function::<unsafe extern "C" fn(*mut c_char, c_uint) -> NvmlReturn>(name)?;
        let mut buffer = vec![0 as c_char; len];
        // SAFETY: the buffer holds `len` bytes, as the length argument says.
        let rc = unsafe { f(buffer.as_mut_ptr(), len as c_uint) };
        self.status(rc, name)?;
        Ok(c_chars_to_string(&buffer))
    }

    /// `nvmlReturn_t f(nvmlDevice_t, char *buf, unsigned int length)`.
    fn device_string(
        &self,
        device: DeviceHandle,
        name: &'static str,
        len: usize,
    ) -> Probed<String> {
        let f = self
            .function::<unsafe extern "C" fn(*mut c_void, *mut c_char, c_uint) -> NvmlReturn>(
                name,
            )?;
        let mut buffer = vec![0 as c_char; len];
        // SAFETY: `device` came from nvmlDeviceGetHandleByIndex_v2; the buffer holds `len` bytes.
        let rc = unsafe { f(device as *mut c_void, buffer.as_mut_ptr(), len as c_uint) };
        self.status(rc, name)?;
        Ok(c_chars_to_string(&buffer))
    }

    /// `nvmlReturn_t f(nvmlDevice_t, unsigned int *value)`.
    fn device_u32(&self, device: DeviceHandle, name: &'static str) -> Probed<u32> {
        let f =
            self.function::<unsafe extern "C" fn(*mut c_void, *mut c_uint) -> NvmlReturn>(name)?;
        let mut value: c_uint = 0;
        // SAFETY: `device` is a valid handle; `value` is a valid out-pointer for the call.
        let rc = unsafe { f(device as *mut c_void, &mut value) };
        self.status(rc, name)?;
        Ok(value)
    }

    /// `nvmlReturn_t f(nvmlDevice_t, nvmlEnableState_t *state)`; the enum is an int.
    fn device_enabled(&self, device: DeviceHandle, name: &'static str) -> Probed<bool> {
        let f =
            self.function::<unsafe extern "C" fn(*mut c_void, *mut c_int) -> NvmlReturn>(name)?;
        let mut value: c_int = 0;
        // SAFETY: as in `device_u32`.
        let rc = unsafe { f(device as *mut c_void, &mut value) };
        self.status(rc, name)?;
        Ok(value != 0)
    }

    fn handle(&self, index: u32) -> Probed<DeviceHandle> {
        let name = "nvmlDeviceGetHandleByIndex_v2";
        let f =
            self.function::<unsafe extern "C" fn(c_uint, *mut *mut c_void) -> NvmlReturn>(name)?;
        let mut device: *mut c_void = std::ptr::null_mut();
        // SAFETY: nvml.h `nvmlDeviceGetHandleByIndex_v2(unsigned int, nvmlDevice_t*)`.
        let rc = unsafe { f(index, &mut device) };
        self.status(rc, name)?;
        Ok(device as DeviceHandle)
    }

    fn nvml_bus_id(&self, device: DeviceHandle) -> Probed<String> {
        let name = "nvmlDeviceGetPciInfo_v3";
        let f = self
            .function::<unsafe extern "C" fn(*mut c_void, *mut NvmlPciInfo) -> NvmlReturn>(name)?;
        // SAFETY: NvmlPciInfo is plain old data; all-zero is a valid value.
        let mut info: NvmlPciInfo = unsafe { std::mem::zeroed() };
        // SAFETY: `info` has the layout nvml.h gives nvmlPciInfo_t for the _v3 call.
        let rc = unsafe { f(device as *mut c_void, &mut info) };
        self.status(rc, name)?;
        let _ = (info.domain, info.bus, info.device, info.pci_device_id);
        let _ = (info.pci_sub_system_id, info.bus_id_legacy);
        Ok(c_chars_to_string(&info.bus_id))
    }

    fn compute_capability(&self, device: DeviceHandle) -> Probed<(i32, i32)> {
        let name = "nvmlDeviceGetCudaComputeCapability";
        let f = self
            .function::<unsafe extern "C" fn(*mut c_void, *mut c_int, *mut c_int) -> NvmlReturn>(
                name,
            )?;
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: nvml.h `(nvmlDevice_t, int *major, int *minor)`.
        let rc = unsafe { f(device as *mut c_void, &mut major, &mut minor) };
        self.status(rc, name)?;
        Ok((major, minor))
    }

    fn memory_total(&self, device: DeviceHandle) -> Probed<u64> {
        let name = "nvmlDeviceGetMemoryInfo";
        let f = self
            .function::<unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> NvmlReturn>(name)?;
        let mut memory = NvmlMemory {
            total: 0,
            free: 0,
            used: 0,
        };
        // SAFETY: nvml.h `(nvmlDevice_t, nvmlMemory_t*)`, v1 layout.
        let rc = unsafe { f(device as *mut c_void, &mut memory) };
        self.status(rc, name)?;
        let _ = (memory.free, memory.used);
        Ok(memory.total)
    }

    fn ecc_mode(&self, device: DeviceHandle) -> Probed<EccMode> {
        let name = "nvmlDeviceGetEccMode";
        let f = self
            .function::<unsafe extern "C" fn(*mut c_void, *mut c_int, *mut c_int) -> NvmlReturn>(
                name,
            )?;
        let (mut current, mut pending): (c_int, c_int) = (0, 0);
        // SAFETY: nvml.h `(nvmlDevice_t, nvmlEnableState_t *current, nvmlEnableState_t *pending)`.
        let rc = unsafe { f(device as *mut c_void, &mut current, &mut pending) };
        self.status(rc, name)?;
        Ok(EccMode {
            current: current != 0,
            pending: pending != 0,
        })
    }

    fn ecc_uncorrected(&self, device: DeviceHandle) -> Probed<EccCounts> {
        let name = "nvmlDeviceGetTotalEccErrors";
        let f = self.function::<unsafe extern "C" fn(
            *mut c_void,
            c_int,
            c_int,
            *mut c_ulonglong,
        ) -> NvmlReturn>(name)?;
        let read = |counter: c_int| -> Probed<u64> {
            let mut count: c_ulonglong = 0;
            // SAFETY: nvml.h `(nvmlDevice_t, nvmlMemoryErrorType_t, nvmlEccCounterType_t,
            // unsigned long long*)`; both enums are ints.
            let rc = unsafe {
                f(
                    device as *mut c_void,
                    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    counter,
                    &mut count,
                )
            };
            self.status(rc, name)?;
            Ok(count)
        };
        Ok(EccCounts {
            volatile: read(NVML_VOLATILE_ECC)?,
            aggregate: read(NVML_AGGREGATE_ECC)?,
        })
    }

    fn retired_pages(&self, device: DeviceHandle) -> Probed<RetiredPages> {
        let name = "nvmlDeviceGetRetiredPages";
        let f = self.function::<unsafe extern "C" fn(
            *mut c_void,
            c_int,
            *mut c_uint,
            *mut c_ulonglong,
        ) -> NvmlReturn>(name)?;
        let count = |cause: c_int| -> Probed<u32> {
            let mut count: c_uint = 0;
            // SAFETY: nvml.h `(nvmlDevice_t, nvmlPageRetirementCause_t, unsigned int *pageCount,
            // unsigned long long *addresses)`: a count of 0 with no buffer asks for the count.
            let rc = unsafe {
                f(
                    device as *mut c_void,
                    cause,
                    &mut count,
                    std::ptr::null_mut(),
                )
            };
            if rc == NVML_ERROR_INSUFFICIENT_SIZE {
                return Ok(count);
            }
            self.status(rc, name)?;
            Ok(count)
        };
        let single_bit = count(NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT)?;
        let double_bit = count(NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT)?;
        let pending = self
            .device_enabled(device, "nvmlDeviceGetRetiredPagesPendingStatus")
            .unwrap_or(false);
        Ok(RetiredPages {
            single_bit,
            double_bit,
            pending,
        })
    }

    fn row_remap(&self, device: DeviceHandle) -> Probed<RowRemap> {
        let name = "nvmlDeviceGetRemappedRows";
        let f = self.function::<unsafe extern "C" fn(
            *mut c_void,
            *mut c_uint,
            *mut c_uint,
            *mut c_uint,
            *mut c_uint,
        ) -> NvmlReturn>(name)?;
        let (mut correctable, mut uncorrectable, mut pending, mut failure) = (0, 0, 0, 0);
        // SAFETY: nvml.h `(nvmlDevice_t, unsigned int *corrRows, unsigned int *uncRows,
        // unsigned int *isPending, unsigned int *failureOccurred)`.
        let rc = unsafe {
            f(
                device as *mut c_void,
                &mut correctable,
                &mut uncorrectable,
                &mut pending,
                &mut failure,
            )
        };
        self.status(rc, name)?;
        Ok(RowRemap {
            correctable,
            uncorrectable,
            pending: pending != 0,
            failure: failure != 0,
        })
    }

    fn clock_event_reasons(&self, device: DeviceHandle) -> Probed<u64> {
        type Reasons = unsafe extern "C" fn(*mut c_void, *mut c_ulonglong) -> NvmlReturn;
        let (name, f) = match self.function::<Reasons>("nvmlDeviceGetCurrentClocksEventReasons") {
            Ok(f) => ("nvmlDeviceGetCurrentClocksEventReasons", f),
            Err(_) => (
                "nvmlDeviceGetCurrentClocksThrottleReasons",
                self.function::<Reasons>("nvmlDeviceGetCurrentClocksThrottleReasons")?,
            ),
        };
        let mut mask: c_ulonglong = 0;
        // SAFETY: nvml.h `(nvmlDevice_t, unsigned long long *clocksEventReasons)`.
        let rc = unsafe { f(device as *mut c_void, &mut mask) };
        self.status(rc, name)?;
        Ok(mask)
    }

    /// `nvmlReturn_t f(nvmlDevice_t, <int enum> which, unsigned int *value)`.
    fn device_u32_of(&self, device: DeviceHandle, name: &'static str, which: c_int) -> Probed<u32> {
        let f = self
            .function::<unsafe extern "C" fn(*mut c_void, c_int, *mut c_uint) -> NvmlReturn>(
                name,
            )?;
        let mut value: c_uint = 0;
        // SAFETY: nvmlDeviceGetTemperature / GetTemperatureThreshold take
        // `(nvmlDevice_t, <enum>, unsigned int*)`.
        let rc = unsafe { f(device as *mut c_void, which, &mut value) };
        self.status(rc, name)?;
        Ok(value)
    }

    fn mig_mode(&self, device: DeviceHandle) -> Probed<MigMode> {
        let name = "nvmlDeviceGetMigMode";
        let f = self
            .function::<unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut c_uint) -> NvmlReturn>(
                name,
            )?;
        let (mut current, mut pending): (c_uint, c_uint) = (0, 0);
        // SAFETY: nvml.h `(nvmlDevice_t, unsigned int *currentMode, unsigned int *pendingMode)`.
        let rc = unsafe { f(device as *mut c_void, &mut current, &mut pending) };
        self.status(rc, name)?;
        Ok(MigMode {
            current: current != 0,
            pending: pending != 0,
        })
    }

    fn nvlinks(&self, device: DeviceHandle) -> Probed<Vec<NvLink>> {
        let state_name = "nvmlDeviceGetNvLinkState";
        let state = self
            .function::<unsafe extern "C" fn(*mut c_void, c_uint, *mut c_int) -> NvmlReturn>(
                state_name,
            )?;
        let version = self
            .function::<unsafe extern "C" fn(*mut c_void, c_uint, *mut c_uint) -> NvmlReturn>(
                "nvmlDeviceGetNvLinkVersion",
            )
            .ok();
        let mut links = Vec::new();
        for link in 0..NVLINK_MAX_LINKS {
            let mut active: c_int = 0;
            // SAFETY: nvml.h `(nvmlDevice_t, unsigned int link, nvmlEnableState_t *isActive)`.
            let rc = unsafe { state(device as *mut c_void, link, &mut active) };
            match rc {
                NVML_SUCCESS => {}
                // Past the last link, or a GPU without NVLink.
                NVML_ERROR_INVALID_ARGUMENT | NVML_ERROR_NOT_SUPPORTED if link > 0 => break,
                NVML_ERROR_INVALID_ARGUMENT => return Err(Unavailable::NotSupported),
                _ => {
                    self.status(rc, state_name)?;
                }
            }
            let link_version = version.and_then(|f| {
                let mut v: c_uint = 0;
                // SAFETY: nvml.h `(nvmlDevice_t, unsigned int link, unsigned int *version)`.
                let rc = unsafe { f(device as *mut c_void, link, &mut v) };
                (rc == NVML_SUCCESS).then_some(v)
            });
            links.push(NvLink {
                link,
                active: active != 0,
                version: link_version,
            });
        }
        Ok(links)
    }

    fn utilisation_busy(&self, device: DeviceHandle) -> Option<bool> {
        let name = "nvmlDeviceGetUtilizationRates";
        let f = self
            .function::<unsafe extern "C" fn(*mut c_void, *mut NvmlUtilization) -> NvmlReturn>(name)
            .ok()?;
        let mut rates = NvmlUtilization { gpu: 0, memory: 0 };
        // SAFETY: nvml.h `(nvmlDevice_t, nvmlUtilization_t*)`.
        let rc = unsafe { f(device as *mut c_void, &mut rates) };
        (rc == NVML_SUCCESS).then_some(rates.gpu > 0 || rates.memory > 0)
    }
}

impl Nvml {
    fn memory_info(&self, device: DeviceHandle) -> Probed<NvmlMemory> {
        let name = "nvmlDeviceGetMemoryInfo";
        let f = self
            .function::<unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> NvmlReturn>(name)?;
        let mut memory = NvmlMemory {
            total: 0,
            free: 0,
            used: 0,
        };
        // SAFETY: nvml.h `(nvmlDevice_t, nvmlMemory_t*)`, v1 layout.
        let rc = unsafe { f(device as *mut c_void, &mut memory) };
        self.status(rc, name)?;
        Ok(memory)
    }

    fn utilization(&self, device: DeviceHandle) -> Probed<NvmlUtilization> {
        let name = "nvmlDeviceGetUtilizationRates";
        let f = self
            .function::<unsafe extern "C" fn(*mut c_void, *mut NvmlUtilization) -> NvmlReturn>(
                name,
            )?;
        let mut rates = NvmlUtilization { gpu: 0, memory: 0 };
        // SAFETY: nvml.h `(nvmlDevice_t, nvmlUtilization_t*)`.
        let rc = unsafe { f(device as *mut c_void, &mut rates) };
        self.status(rc, name)?;
        Ok(rates)
    }

    fn ecc_volatile(&self, device: DeviceHandle, error_type: c_int) -> Probed<u64> {
        let name = "nvmlDeviceGetTotalEccErrors";
        let f = self.function::<unsafe extern "C" fn(
            *mut c_void,
            c_int,
            c_int,
            *mut c_ulonglong,
        ) -> NvmlReturn>(name)?;
        let mut count: c_ulonglong = 0;
        // SAFETY: as in `ecc_uncorrected`.
        let rc = unsafe {
            f(
                device as *mut c_void,
                error_type,
                NVML_VOLATILE_ECC,
                &mut count,
            )
        };
        self.status(rc, name)?;
        Ok(count)
    }

    /// Critical XID events of `device` seen since the first reading: an event set is created
    /// then, each device registered once, and every reading drains the set without waiting.
    fn xid_count(&self, device: DeviceHandle) -> Probed<u64> {
        let Ok(mut xid) = self.xid.lock() else {
            return Err(Unavailable::Failed("XID event state poisoned".into()));
        };
        if let Some(why) = &xid.unavailable {
            return Err(why.clone());
        }
        if xid.set == 0 {
            let name = "nvmlEventSetCreate";
            let created = self
                .function::<unsafe extern "C" fn(*mut *mut c_void) -> NvmlReturn>(name)
                .and_then(|f| {
                    let mut set: *mut c_void = std::ptr::null_mut();
                    // SAFETY: nvml.h `nvmlEventSetCreate(nvmlEventSet_t *set)`.
                    let rc = unsafe { f(&mut set) };
                    self.status(rc, name).map(|()| set as usize)
                });
            match created {
                Ok(set) => xid.set = set,
                Err(e) => {
                    xid.unavailable = Some(e.clone());
                    return Err(e);
                }
            }
        }
        if !xid.registered.contains(&device) {
            let name = "nvmlDeviceRegisterEvents";
            let f = self.function::<unsafe extern "C" fn(
                *mut c_void,
                c_ulonglong,
                *mut c_void,
            ) -> NvmlReturn>(name)?;
            // SAFETY: nvml.h `(nvmlDevice_t, unsigned long long eventTypes, nvmlEventSet_t)`;
            // the set was created above and lives until drop.
            let rc = unsafe {
                f(
                    device as *mut c_void,
                    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
                    xid.set as *mut c_void,
                )
            };
            self.status(rc, name)?;
            xid.registered.push(device);
            xid.counts.insert(device, 0);
        }
        let name = "nvmlEventSetWait_v2";
        if let Ok(wait) = self.function::<unsafe extern "C" fn(
            *mut c_void,
            *mut NvmlEventData,
            c_uint,
        ) -> NvmlReturn>(name)
        {
            for _ in 0..XID_EVENTS_PER_READING {
                let mut data = NvmlEventData {
                    device: std::ptr::null_mut(),
                    event_type: 0,
                    event_data: 0,
                    gpu_instance_id: 0,
                    compute_instance_id: 0,
                };
                // SAFETY: nvml.h `(nvmlEventSet_t, nvmlEventData_t*, unsigned int timeoutms)`;
                // a timeout of 0 returns at once (NVML_ERROR_TIMEOUT when nothing is pending).
                let rc = unsafe { wait(xid.set as *mut c_void, &mut data, 0) };
                // NVML_ERROR_TIMEOUT: drained. Another error ends this drain; the next
                // reading tries again and the count stays where it was.
                if rc != NVML_SUCCESS {
                    break;
                }
                let _ = (
                    data.event_data,
                    data.gpu_instance_id,
                    data.compute_instance_id,
                );
                if data.event_type & NVML_EVENT_TYPE_XID_CRITICAL_ERROR != 0 {
                    *xid.counts.entry(data.device as DeviceHandle).or_insert(0) += 1;
                }
            }
        }
        Ok(xid.counts.get(&device).copied().unwrap_or(0))
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        let set = self.xid.get_mut().map(|x| x.set).unwrap_or(0);
        if set != 0 {
            if let Ok(f) =
                self.function::<unsafe extern "C" fn(*mut c_void) -> NvmlReturn>("nvmlEventSetFree")
            {
                // SAFETY: nvml.h `nvmlEventSetFree(nvmlEventSet_t)`, on the set we created.
                unsafe { f(set as *mut c_void) };
            }
        }
        if !self.initialised {
            return;
        }
        if let Ok(f) = self.function::<unsafe extern "C" fn() -> NvmlReturn>("nvmlShutdown") {
            // SAFETY: nvml.h `nvmlReturn_t nvmlShutdown(void)`, balancing our nvmlInit.
            unsafe { f() };
        }
    }
}

/// An error with its causes (libloading keeps dlerror()'s text in the source).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn c_chars_to_string(buffer: &[c_char]) -> String {
    let bytes: Vec<u8> = buffer
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

impl GpuProbe for Nvml {
    fn source(&self) -> String {
        if self.version.is_empty() {
            "NVML".to_string()
        } else {
            format!("NVML {}", self.version)
        }
    }

    fn system(&self) -> GpuSystem {
        let cuda = self
            .function::<unsafe extern "C" fn(*mut c_int) -> NvmlReturn>(
                "nvmlSystemGetCudaDriverVersion_v2",
            )
            .or_else(|_| {
                self.function::<unsafe extern "C" fn(*mut c_int) -> NvmlReturn>(
                    "nvmlSystemGetCudaDriverVersion",
                )
            })
            .and_then(|f| {
                let mut version: c_int = 0;
                // SAFETY: nvml.h `nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)`.
                let rc = unsafe { f(&mut version) };
                self.status(rc, "nvmlSystemGetCudaDriverVersion")?;
                Ok(version)
            });
        let count = self
            .function::<unsafe extern "C" fn(*mut c_uint) -> NvmlReturn>("nvmlDeviceGetCount_v2")
            .and_then(|f| {
                let mut count: c_uint = 0;
                // SAFETY: nvml.h `nvmlDeviceGetCount_v2(unsigned int *deviceCount)`.
                let rc = unsafe { f(&mut count) };
                self.status(rc, "nvmlDeviceGetCount_v2")?;
                Ok(count)
            });
        GpuSystem {
            driver_version: self.string_query("nvmlSystemGetDriverVersion", 80),
            cuda_driver_version: cuda,
            nvml_version: self.string_query("nvmlSystemGetNVMLVersion", 80),
            device_count: count,
        }
    }

    fn device(&self, index: u32) -> GpuDevice {
        let handle = self.handle(index);
        let h = || handle.clone();
        GpuDevice {
            index,
            name: h().and_then(|d| self.device_string(d, "nvmlDeviceGetName", 96)),
            uuid: h().and_then(|d| self.device_string(d, "nvmlDeviceGetUUID", 96)),
            pci_bus_id: h()
                .and_then(|d| self.nvml_bus_id(d))
                .map(|b| sysfs_bus_id(&b)),
            vbios_version: h().and_then(|d| self.device_string(d, "nvmlDeviceGetVbiosVersion", 32)),
            compute_capability: h().and_then(|d| self.compute_capability(d)),
            memory_total_bytes: h().and_then(|d| self.memory_total(d)),
            persistence_mode: h()
                .and_then(|d| self.device_enabled(d, "nvmlDeviceGetPersistenceMode")),
            ecc_mode: h().and_then(|d| self.ecc_mode(d)),
            ecc_uncorrected: h().and_then(|d| self.ecc_uncorrected(d)),
            retired_pages: h().and_then(|d| self.retired_pages(d)),
            row_remap: h().and_then(|d| self.row_remap(d)),
            pcie_max: h().and_then(|d| {
                Ok(PcieLink {
                    gen: self.device_u32(d, "nvmlDeviceGetMaxPcieLinkGeneration")?,
                    width: self.device_u32(d, "nvmlDeviceGetMaxPcieLinkWidth")?,
                })
            }),
            clock_event_reasons: h().and_then(|d| self.clock_event_reasons(d)),
            temperature_c: h().and_then(|d| {
                self.device_u32_of(d, "nvmlDeviceGetTemperature", NVML_TEMPERATURE_GPU)
            }),
            slowdown_temperature_c: h().and_then(|d| {
                self.device_u32_of(
                    d,
                    "nvmlDeviceGetTemperatureThreshold",
                    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
                )
            }),
            power_usage_mw: h().and_then(|d| self.device_u32(d, "nvmlDeviceGetPowerUsage")),
            power_limit_mw: h().and_then(|d| self.device_u32(d, "nvmlDeviceGetEnforcedPowerLimit")),
            power_default_limit_mw: h()
                .and_then(|d| self.device_u32(d, "nvmlDeviceGetPowerManagementDefaultLimit")),
            mig_mode: h().and_then(|d| self.mig_mode(d)),
            nvlinks: h().and_then(|d| self.nvlinks(d)),
        }
    }

    fn telemetry(&self, index: u32) -> GpuTelemetry {
        let handle = self.handle(index);
        let h = || handle.clone();
        let memory = h().and_then(|d| self.memory_info(d));
        let rates = h().and_then(|d| self.utilization(d));
        let clock =
            |name: &'static str, which: c_int| h().and_then(|d| self.device_u32_of(d, name, which));
        let link = |gen: &'static str, width: &'static str| {
            h().and_then(|d| {
                Ok(PcieLink {
                    gen: self.device_u32(d, gen)?,
                    width: self.device_u32(d, width)?,
                })
            })
        };
        GpuTelemetry {
            index,
            utilization_gpu_percent: rates.as_ref().map(|r| r.gpu).map_err(Clone::clone),
            utilization_memory_percent: rates.as_ref().map(|r| r.memory).map_err(Clone::clone),
            memory_used_bytes: memory.as_ref().map(|m| m.used).map_err(Clone::clone),
            memory_total_bytes: memory.as_ref().map(|m| m.total).map_err(Clone::clone),
            temperature_c: clock("nvmlDeviceGetTemperature", NVML_TEMPERATURE_GPU),
            power_usage_mw: h().and_then(|d| self.device_u32(d, "nvmlDeviceGetPowerUsage")),
            power_limit_mw: h().and_then(|d| self.device_u32(d, "nvmlDeviceGetEnforcedPowerLimit")),
            sm_clock_mhz: clock("nvmlDeviceGetClockInfo", NVML_CLOCK_SM),
            sm_clock_max_mhz: clock("nvmlDeviceGetMaxClockInfo", NVML_CLOCK_SM),
            memory_clock_mhz: clock("nvmlDeviceGetClockInfo", NVML_CLOCK_MEM),
            memory_clock_max_mhz: clock("nvmlDeviceGetMaxClockInfo", NVML_CLOCK_MEM),
            clock_event_reasons: h().and_then(|d| self.clock_event_reasons(d)),
            pcie_current: link(
                "nvmlDeviceGetCurrPcieLinkGeneration",
                "nvmlDeviceGetCurrPcieLinkWidth",
            ),
            pcie_max: link(
                "nvmlDeviceGetMaxPcieLinkGeneration",
                "nvmlDeviceGetMaxPcieLinkWidth",
            ),
            ecc_corrected_volatile: h()
                .and_then(|d| self.ecc_volatile(d, NVML_MEMORY_ERROR_TYPE_CORRECTED)),
            ecc_uncorrected_volatile: h()
                .and_then(|d| self.ecc_volatile(d, NVML_MEMORY_ERROR_TYPE_UNCORRECTED)),
            xid_errors: h().and_then(|d| self.xid_count(d)),
        }
    }

    fn pcie_sample(&self, index: u32) -> Probed<PcieSample> {
        let d = self.handle(index)?;
        let gen = self.device_u32(d, "nvmlDeviceGetCurrPcieLinkGeneration")?;
        let width = self.device_u32(d, "nvmlDeviceGetCurrPcieLinkWidth")?;
        let idle_reason = self
            .clock_event_reasons(d)
            .ok()
            .map(|mask| mask & clock_reasons::GPU_IDLE != 0);
        let busy = match (self.utilisation_busy(d), idle_reason) {
            (Some(true), _) => Some(true),
            (_, Some(idle)) => Some(!idle),
            (Some(false), None) => Some(false),
            (None, None) => None,
        };
        Ok(PcieSample { gen, width, busy })
    }

    fn pcie_under_load(&self, index: u32, samples: u32, window: Duration) -> PcieSampling {
        let bus_id = match self.handle(index).and_then(|d| self.nvml_bus_id(d)) {
            Ok(b) => b,
            Err(e) => {
                return PcieSampling {
                    samples: sample_spread(|| self.pcie_sample(index), samples, window),
                    load: LoadApplied::None(format!("no PCI bus id for the CUDA load: {e}")),
                }
            }
        };
        let load = CudaCopyLoad::start(bus_id, window + Duration::from_secs(3));
        match load.started(Duration::from_secs(5)) {
            Ok(()) => {
                let readings = sample_spread(|| self.pcie_sample(index), samples, window);
                PcieSampling {
                    samples: readings,
                    load: load.finish(),
                }
            }
            Err(reason) => PcieSampling {
                samples: sample_spread(|| self.pcie_sample(index), samples, window),
                load: LoadApplied::None(format!("CUDA load not started: {reason}")),
            },
        }
    }
}

/// Why the CUDA copy load did not run (or stopped).
#[derive(Clone, Debug, thiserror::Error)]
enum CudaLoadError {
    #[error("cannot start a thread: {0}")]
    Thread(#[source] Arc<std::io::Error>),
    #[error("libcuda.so.1 not loadable ({0})")]
    Library(String),
    #[error("libcuda has no {0}")]
    MissingSymbol(&'static str),
    #[error("bus id holds a NUL byte")]
    BusIdNul,
    /// A driver call answered an error code.
    #[error("{call} failed (CUresult {rc})")]
    Call { call: String, rc: CuResult },
    #[error("no CUDA context or {mib} MiB of GPU memory (CUresult {rc})")]
    NoMemory { mib: usize, rc: CuResult },
    #[error("no CUDA context within {seconds} s")]
    ContextTimeout { seconds: u64 },
}

/// Host-to-device copies on one GPU, in a thread of their own, while the caller samples the
/// link. A copy needs the link at speed, so a link that stays below its maximum under it is
/// downtrained, not resting.
struct CudaCopyLoad {
    stop: Arc<AtomicBool>,
    started: mpsc::Receiver<Result<(), CudaLoadError>>,
    worker: Option<std::thread::JoinHandle<Result<(u64, u64), CudaLoadError>>>,
}

/// Bytes per copy: large enough that copies dominate the loop, small enough for any GPU.
const COPY_BYTES: usize = 64 << 20;

type CuResult = c_int;

impl CudaCopyLoad {
    fn start(nvml_bus_id: String, max_run: Duration) -> CudaCopyLoad {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let worker_stop = stop.clone();
        let worker = std::thread::Builder::new()
            .name("rampart-doctor-cuda-load".into())
            .spawn(move || copy_loop(&nvml_bus_id, &worker_stop, &tx, max_run));
        match worker {
            Ok(handle) => CudaCopyLoad {
                stop,
                started: rx,
                worker: Some(handle),
            },
            Err(e) => {
                let (tx, rx) = mpsc::channel();
                let _ = tx.send(Err(CudaLoadError::Thread(Arc::new(e))));
                CudaCopyLoad {
                    stop,
                    started: rx,
                    worker: None,
                }
            }
        }
    }

    fn started(&self, timeout: Duration) -> Result<(), CudaLoadError> {
        match self.started.recv_timeout(timeout) {
            Ok(result) => result,
            Err(_) => {
                // A context that takes this long is itself a finding; the worker sees the stop
                // flag before its first copy.
                self.stop.store(true, Ordering::Relaxed);
                Err(CudaLoadError::ContextTimeout {
                    seconds: timeout.as_secs(),
                })
            }
        }
    }

    fn finish(mut self) -> LoadApplied {
        self.stop.store(true, Ordering::Relaxed);
        match self.worker.take().map(|w| w.join()) {
            Some(Ok(Ok((bytes, elapsed_ms)))) => LoadApplied::Copies { bytes, elapsed_ms },
            Some(Ok(Err(reason))) => LoadApplied::None(reason.to_string()),
            Some(Err(_)) => LoadApplied::None("the CUDA load thread panicked".into()),
            None => LoadApplied::None("no CUDA load thread".into()),
        }
    }
}

impl Drop for CudaCopyLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn copy_loop(
    nvml_bus_id: &str,
    stop: &AtomicBool,
    started: &mpsc::Sender<Result<(), CudaLoadError>>,
    max_run: Duration,
) -> Result<(u64, u64), CudaLoadError> {
    let fail = |reason: CudaLoadError| {
        let _ = started.send(Err(reason.clone()));
        Err(reason)
    };
    // SAFETY: opening the CUDA driver library runs its initialisers, which have no
    // preconditions on our side.
    let lib = match unsafe { Library::new("libcuda.so.1") } {
        Ok(lib) => lib,
        Err(e) => return fail(CudaLoadError::Library(error_chain(&e))),
    };
    macro_rules! cuda_fn {
        ($name:literal, $ty:ty) => {
            // SAFETY: `$ty` is the signature cuda.h declares for `$name`; called only while
            // `lib` is loaded (it lives to the end of this function).
            match unsafe { lib.get::<$ty>($name) } {
                Ok(symbol) => *symbol,
                Err(_) => return fail(CudaLoadError::MissingSymbol($name)),
            }
        };
    }
    let cu_init = cuda_fn!("cuInit", unsafe extern "C" fn(c_uint) -> CuResult);
    let cu_device_by_bus = cuda_fn!(
        "cuDeviceGetByPCIBusId",
        unsafe extern "C" fn(*mut c_int, *const c_char) -> CuResult
    );
    let cu_retain = cuda_fn!(
        "cuDevicePrimaryCtxRetain",
        unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult
    );
    let cu_release = cuda_fn!(
        "cuDevicePrimaryCtxRelease_v2",
        unsafe extern "C" fn(c_int) -> CuResult
    );
    let cu_set_current = cuda_fn!(
        "cuCtxSetCurrent",
        unsafe extern "C" fn(*mut c_void) -> CuResult
    );
    let cu_alloc = cuda_fn!(
        "cuMemAlloc_v2",
        unsafe extern "C" fn(*mut u64, usize) -> CuResult
    );
    let cu_free = cuda_fn!("cuMemFree_v2", unsafe extern "C" fn(u64) -> CuResult);
    let cu_copy = cuda_fn!(
        "cuMemcpyHtoD_v2",
        unsafe extern "C" fn(u64, *const c_void, usize) -> CuResult
    );

    // SAFETY: cuda.h `CUresult cuInit(unsigned int Flags)`; Flags must be 0.
    let rc = unsafe { cu_init(0) };
    if rc != 0 {
        return fail(CudaLoadError::Call {
            call: "cuInit".into(),
            rc,
        });
    }
    let Ok(bus) = std::ffi::CString::new(nvml_bus_id) else {
        return fail(CudaLoadError::BusIdNul);
    };
    let mut device: c_int = 0;
    // SAFETY: cuda.h `cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId)`; `bus` is
    // NUL-terminated and outlives the call.
    let rc = unsafe { cu_device_by_bus(&mut device, bus.as_ptr()) };
    if rc != 0 {
        return fail(CudaLoadError::Call {
            call: format!("cuDeviceGetByPCIBusId({nvml_bus_id})"),
            rc,
        });
    }
    let mut context: *mut c_void = std::ptr::null_mut();
    // SAFETY: cuda.h `cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`.
    let rc = unsafe { cu_retain(&mut context, device) };
    if rc != 0 {
        return fail(CudaLoadError::Call {
            call: "cuDevicePrimaryCtxRetain".into(),
            rc,
        });
    }
    // SAFETY: cuda.h `cuCtxSetCurrent(CUcontext)` with the context just retained.
    let rc = unsafe { cu_set_current(context) };
    let mut device_buffer: u64 = 0;
    // SAFETY: cuda.h `cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)` in the current context.
    let alloc_rc = if rc == 0 {
        unsafe { cu_alloc(&mut device_buffer, COPY_BYTES) }
    } else {
        rc
    };
    let outcome = if alloc_rc != 0 {
        fail(CudaLoadError::NoMemory {
            mib: COPY_BYTES >> 20,
            rc: alloc_rc,
        })
    } else {
        let host = vec![0u8; COPY_BYTES];
        let _ = started.send(Ok(()));
        let begin = std::time::Instant::now();
        let mut bytes = 0u64;
        let mut result = Ok(());
        while !stop.load(Ordering::Relaxed) && begin.elapsed() < max_run {
            // SAFETY: cuda.h `cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)`: the
            // device buffer and `host` both hold COPY_BYTES.
            let rc = unsafe { cu_copy(device_buffer, host.as_ptr().cast(), COPY_BYTES) };
            if rc != 0 {
                result = Err(CudaLoadError::Call {
                    call: "cuMemcpyHtoD".into(),
                    rc,
                });
                break;
            }
            bytes += COPY_BYTES as u64;
        }
        // SAFETY: frees the buffer allocated above, in the same context.
        unsafe { cu_free(device_buffer) };
        result.map(|()| (bytes, begin.elapsed().as_millis() as u64))
    };
    // SAFETY: unbinds the context from this thread, then releases our retain of it.
    unsafe {
        cu_set_current(std::ptr::null_mut());
        cu_release(device);
    }
    outcome
}
