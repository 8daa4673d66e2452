//! The simulator's configuration: the `CUMEM_SIM` syntax, its defaults, and the device table it
//! describes.
//!
//! A specification is a comma-separated list of `key=value` entries. Global keys: `devices`,
//! `memory`, `latency_us`, `leak_check`, `schedule`, `name`, `peer`, `vmm_space`, and any device
//! attribute by its lower-case name (applied to every device). `devN.<key>` overrides `memory`, `name`,
//! `vmm_space` or an attribute for one device. `peer` takes pairs `a-b` (both directions) or `a>b`
//! (one direction), separated by commas (an entry without `=` continues the `peer` list), or `all` /
//! `none`. Later entries win.

use std::collections::BTreeMap;

use crate::attributes;

/// Keys that may still change after `cuInit` (they do not alter the device table).
const RUNTIME_KEYS: &[&str] = &["latency_us", "leak_check", "schedule"];

/// Largest device count the simulator accepts.
pub(crate) const MAX_DEVICES: usize = 64;

/// Which operation the engine starts first among the heads of streams that may all start now
/// (`schedule`). Dependencies decide what may start; this only breaks the tie between independent
/// streams, which a GPU does not order at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum Schedule {
    /// `enqueued`: the one enqueued first, so independent streams run in enqueue order.
    #[default]
    Enqueued,
    /// `reversed`: the one enqueued last, so that a test run under it finds work that relies on
    /// enqueue order instead of on a dependency.
    Reversed,
}

impl Schedule {
    fn parse(text: &str) -> Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "enqueued" => Ok(Schedule::Enqueued),
            "reversed" => Ok(Schedule::Reversed),
            _ => Err(format!("`{text}` is not a schedule (`enqueued` or `reversed`)")),
        }
    }
}

/// Per-device overrides collected from `devN.*` keys.
#[derive(Clone, Debug, Default)]
struct DeviceOverride {
    memory: Option<u64>,
    name: Option<String>,
    attrs: BTreeMap<u32, i32>,
    vmm_space: Option<u64>,
}

/// The merged configuration (defaults, then `CUMEM_SIM`, then `cumemSimConfigure` calls).
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) devices: usize,
    pub(crate) memory: u64,
    pub(crate) latency_us: u64,
    pub(crate) leak_check: bool,
    pub(crate) schedule: Schedule,
    name: Option<String>,
    attrs: BTreeMap<u32, i32>,
    per_device: BTreeMap<usize, DeviceOverride>,
    /// `None` = every device can access every other device.
    peer: Option<Vec<(usize, usize)>>,
    /// `vmm_space`: each VMM device's address space for reservations; `None` = sized to share the
    /// host's address space (see `crate::vmm::space_bytes`).
    vmm_space: Option<u64>,
}

/// The description of one simulated device, produced at `cuInit`.
#[derive(Clone, Debug)]
pub(crate) struct DeviceSpec {
    pub(crate) name: String,
    pub(crate) memory: u64,
    pub(crate) attrs: Vec<Option<i32>>,
    /// Bytes of address space for its `cuMemAddressReserve` ranges (0 without VMM).
    pub(crate) vmm_space: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            devices: 2,
            memory: 16 << 30,
            latency_us: 200,
            leak_check: false,
            schedule: Schedule::Enqueued,
            name: None,
            attrs: BTreeMap::new(),
            per_device: BTreeMap::new(),
            peer: None,
            vmm_space: None,
        }
    }
}

/// One parsed `key=value` entry.
#[derive(Debug)]
struct Entry {
    key: String,
    value: String,
}

fn entries(spec: &str) -> Result<Vec<Entry>, String> {
    let mut out: Vec<Entry> = Vec::new();
    for raw in spec.split(',') {
        let item = raw.trim();
        if item.is_empty() {
            continue;
        }
        match item.split_once('=') {
            Some((k, v)) => {
                let key = k.trim().to_ascii_lowercase();
                if key.is_empty() {
                    return Err(format!("empty key in `{item}`"));
                }
                out.push(Entry { key, value: v.trim().to_string() });
            }
            None => match out.last_mut() {
                // Peer pairs are themselves comma-separated, so a bare item continues the list.
                Some(last) if last.key == "peer" => {
                    last.value.push(',');
                    last.value.push_str(item);
                }
                _ => return Err(format!("`{item}` is not of the form key=value")),
            },
        }
    }
    Ok(out)
}

/// Parses a byte size: a number with an optional unit (`B`, `KiB`/`K`, `MiB`/`M`, `GiB`/`G`,
/// `TiB`/`T`, binary; `KB`/`MB`/`GB`/`TB`, decimal).
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("`{text}` is not a size"))?;
    let mul: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => return Err(format!("unknown size unit `{other}` in `{text}`")),
    };
    n.checked_mul(mul).ok_or_else(|| format!("size `{text}` overflows"))
}

/// A `vmm_space` value: a non-zero multiple of the VMM granularity.
fn parse_space(text: &str) -> Result<u64, String> {
    let bytes = parse_size(text)?;
    if bytes == 0 || !bytes.is_multiple_of(crate::vmm::GRANULARITY) {
        return Err(format!("vmm_space `{text}` is not a non-zero multiple of 2 MiB"));
    }
    Ok(bytes)
}

fn parse_bool(text: &str) -> Result<bool, String> {
    match text.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("`{text}` is not a boolean")),
    }
}

fn parse_int(text: &str) -> Result<i32, String> {
    let t = text.trim();
    let parsed =
        if let Some(hex) = t.strip_prefix("0x") { i64::from_str_radix(hex, 16) } else { t.parse::<i64>() };
    parsed.ok().and_then(|v| i32::try_from(v).ok()).ok_or_else(|| format!("`{text}` is not a 32-bit integer"))
}

/// Attributes whose only modelled value is their default: the simulator's address space is
/// unified (41), and a registered range's device address is its host address (91). Describing a
/// device without them would need a separate device alias for registered memory and a split
/// address space, which the simulator does not implement, so such a configuration is refused
/// rather than answered while behaving otherwise.
/// Likewise the capabilities whose behaviour or entry points are not modelled stay 0, so that no
/// configuration advertises what the simulator does not do: texture gather (44), pageable memory
/// access from the device (88, 100: copies and hints refuse pageable device pointers), stream
/// memory operations (92-94, 122, 123), cooperative launches (95, 96), remote-write flushes (98),
/// Win32 and fabric handles (104, 105, 128), generic compression (107), the persisting-L2 access
/// policy window (109), GPUDirect RDMA (110, 116-118), sparse and deferred-mapping CUDA arrays
/// (112, 121), timeline semaphores (114), cluster launches (120), dma-buf export (124), memory
/// synchronisation domains (126), tensor maps (127), unified function pointers (129), NUMA
/// (130), multicast (132), D3D12 CIG (135), memory decompression (136, 137) and multinode host
/// NUMA IPC (143). Informational attributes (sizes, clocks, limits of kernels that never run)
/// stay configurable.
const FIXED_ATTRIBUTES: &[(u32, i32)] = &[
    (41, 1),
    (44, 0),
    (88, 0),
    (91, 1),
    (92, 0),
    (93, 0),
    (94, 0),
    (95, 0),
    (96, 0),
    (98, 0),
    (100, 0),
    (104, 0),
    (105, 0),
    (107, 0),
    (109, 0),
    (110, 0),
    (112, 0),
    (114, 0),
    (116, 0),
    (117, 0),
    (118, 0),
    (120, 0),
    (121, 0),
    (122, 0),
    (123, 0),
    (124, 0),
    (126, 0),
    (127, 0),
    (128, 0),
    (129, 0),
    (130, 0),
    (132, 0),
    (135, 0),
    (136, 0),
    (137, 0),
    (143, 0),
];

/// Parses the value of attribute `n` (configured as `key`), refusing values the simulator would
/// only report without behaving accordingly.
fn attribute_value(n: u32, key: &str, value: &str) -> Result<i32, String> {
    let v = parse_int(value)?;
    match FIXED_ATTRIBUTES.iter().find(|&&(fixed, _)| fixed == n) {
        Some(&(_, only)) if v != only => {
            Err(format!("`{key}={v}` is not simulated: the simulator implements only {key}={only}"))
        }
        // Pools are exported as POSIX descriptors only: a mask with another handle type would
        // let `cuMemPoolCreate` make pools whose export the simulator refuses.
        _ if n == 119 && v & !1 != 0 => {
            Err(format!("`{key}={v}` is not simulated: pools export POSIX descriptors only ({key}=0 or 1)"))
        }
        _ => Ok(v),
    }
}

fn parse_peer(text: &str) -> Result<Option<Vec<(usize, usize)>>, String> {
    match text {
        "all" => return Ok(None),
        "none" | "" => return Ok(Some(Vec::new())),
        _ => {}
    }
    let mut pairs = Vec::new();
    for item in text.split(',') {
        let item = item.trim();
        let (pair, both) = if let Some((a, b)) = item.split_once('-') {
            ((a, b), true)
        } else if let Some((a, b)) = item.split_once('>') {
            ((a, b), false)
        } else {
            return Err(format!("peer entry `{item}` is not `a-b` or `a>b`"));
        };
        let a: usize = pair.0.trim().parse().map_err(|_| format!("bad device in `{item}`"))?;
        let b: usize = pair.1.trim().parse().map_err(|_| format!("bad device in `{item}`"))?;
        pairs.push((a, b));
        if both {
            pairs.push((b, a));
        }
    }
    Ok(Some(pairs))
}

impl Config {
    /// Applies `spec` on top of `self`. With `runtime_only`, any key that would change the device
    /// table is refused. Nothing is applied unless the whole specification is valid.
    pub(crate) fn apply(&mut self, spec: &str, runtime_only: bool) -> Result<(), String> {
        let entries = entries(spec)?;
        let mut next = self.clone();
        for Entry { key, value } in entries {
            if runtime_only && !RUNTIME_KEYS.contains(&key.as_str()) {
                return Err(format!("`{key}` cannot change after cuInit"));
            }
            next.apply_one(&key, &value)?;
        }
        next.device_specs()?;
        *self = next;
        Ok(())
    }

    fn apply_one(&mut self, key: &str, value: &str) -> Result<(), String> {
        match key {
            "devices" => {
                let n: usize = value.parse().map_err(|_| format!("`{value}` is not a device count"))?;
                if n > MAX_DEVICES {
                    return Err(format!("at most {MAX_DEVICES} devices"));
                }
                self.devices = n;
            }
            "memory" => self.memory = parse_size(value)?,
            "latency_us" => {
                self.latency_us = value.parse().map_err(|_| format!("`{value}` is not microseconds"))?
            }
            "leak_check" => self.leak_check = parse_bool(value)?,
            "schedule" => self.schedule = Schedule::parse(value)?,
            "name" => self.name = Some(value.to_string()),
            "peer" => self.peer = parse_peer(value)?,
            "vmm_space" => self.vmm_space = Some(parse_space(value)?),
            _ => {
                if let Some(rest) = key.strip_prefix("dev")
                    && let Some((idx, sub)) = rest.split_once('.')
                {
                    let idx: usize = idx.parse().map_err(|_| format!("bad device index in `{key}`"))?;
                    if idx >= MAX_DEVICES {
                        return Err(format!("device index in `{key}` is too large"));
                    }
                    let over = self.per_device.entry(idx).or_default();
                    match sub {
                        "memory" => over.memory = Some(parse_size(value)?),
                        "name" => over.name = Some(value.to_string()),
                        "vmm_space" => over.vmm_space = Some(parse_space(value)?),
                        attr => {
                            let n = attributes::by_name(attr)
                                .ok_or_else(|| format!("unknown device attribute `{attr}`"))?;
                            over.attrs.insert(n, attribute_value(n, attr, value)?);
                        }
                    }
                    return Ok(());
                }
                let n = attributes::by_name(key).ok_or_else(|| format!("unknown key `{key}`"))?;
                self.attrs.insert(n, attribute_value(n, key, value)?);
            }
        }
        Ok(())
    }

    /// The device table this configuration describes (validating per-device keys and peers).
    pub(crate) fn device_specs(&self) -> Result<Vec<DeviceSpec>, String> {
        if let Some(&idx) = self.per_device.keys().find(|&&i| i >= self.devices) {
            return Err(format!("dev{idx}.* given but only {} devices configured", self.devices));
        }
        if let Some(pairs) = &self.peer
            && let Some(&(a, b)) = pairs.iter().find(|&&(a, b)| a >= self.devices || b >= self.devices)
        {
            return Err(format!("peer pair {a}-{b} names a device that does not exist"));
        }
        let vmm = |attrs: &[Option<i32>]| attrs[attributes::VMM as usize] == Some(1);
        let mut specs: Vec<DeviceSpec> = (0..self.devices)
            .map(|i| {
                let over = self.per_device.get(&i).cloned().unwrap_or_default();
                let mut attrs = attributes::default_table(i);
                for (&n, &v) in self.attrs.iter().chain(over.attrs.iter()) {
                    attrs[n as usize] = Some(v);
                }
                let name = over
                    .name
                    .or_else(|| self.name.clone())
                    .unwrap_or_else(|| format!("cumem-sim H100-like device {i}"));
                DeviceSpec { name, memory: over.memory.unwrap_or(self.memory), attrs, vmm_space: 0 }
            })
            .collect();
        // Sized once for all devices, so that no device's space depends on which used VMM first.
        let vmm_devices = specs.iter().filter(|s| vmm(&s.attrs)).count();
        let space = self.vmm_space.unwrap_or_else(|| crate::vmm::space_bytes(vmm_devices));
        for (i, s) in specs.iter_mut().enumerate().filter(|(_, s)| vmm(&s.attrs)) {
            s.vmm_space = self.per_device.get(&i).and_then(|o| o.vmm_space).unwrap_or(space);
        }
        Ok(specs)
    }

    /// Whether device `a` can access device `b`'s memory (never itself).
    pub(crate) fn peer_matrix(&self) -> Vec<Vec<bool>> {
        let n = self.devices;
        let mut m = vec![vec![self.peer.is_none(); n]; n];
        if let Some(pairs) = &self.peer {
            for &(a, b) in pairs {
                m[a][b] = true;
            }
        }
        for (i, row) in m.iter_mut().enumerate() {
            row[i] = false;
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_example() {
        let mut c = Config::default();
        c.apply("devices=3,memory=4GiB,latency_us=50,dev1.memory=1GiB,dev1.managed_memory=0", false).unwrap();
        let specs = c.device_specs().unwrap();
        assert_eq!(specs.len(), 3);
        assert_eq!(specs[0].memory, 4 << 30);
        assert_eq!(specs[1].memory, 1 << 30);
        assert_eq!(specs[1].attrs[83], Some(0));
        assert_eq!(specs[0].attrs[83], Some(1));
        assert_eq!(c.latency_us, 50);
    }

    /// Every VMM device's space is sized at once from how many there are (so no device's size
    /// depends on which reserved first): 16 TiB up to three, an equal share of 48 TiB beyond;
    /// `vmm_space` and `devN.vmm_space` force a size; a device without VMM gets none.
    #[test]
    fn vmm_spaces_share_the_host_address_space() {
        let spaces = |spec: &str| {
            let mut c = Config::default();
            c.apply(spec, false).unwrap();
            c.device_specs().unwrap().iter().map(|s| s.vmm_space).collect::<Vec<_>>()
        };
        const T: u64 = 1 << 40;
        assert_eq!(spaces("devices=3"), vec![16 * T; 3]);
        assert_eq!(spaces("devices=4"), vec![12 * T; 4]);
        assert_eq!(spaces("devices=5,dev4.vmm=0"), vec![12 * T, 12 * T, 12 * T, 12 * T, 0]);
        assert_eq!(spaces("devices=64")[63], 768 << 30);
        assert_eq!(spaces("devices=2,vmm_space=64GiB,dev1.vmm_space=1TiB"), vec![64 << 30, T]);
        let mut c = Config::default();
        for bad in ["vmm_space=0", "vmm_space=3MiB", "dev0.vmm_space=1KiB"] {
            assert!(c.apply(bad, false).is_err(), "{bad}");
        }
    }

    #[test]
    fn vmm_key_describes_a_device_without_vmm() {
        let mut c = Config::default();
        c.apply("devices=2,dev1.vmm=0", false).unwrap();
        let specs = c.device_specs().unwrap();
        assert_eq!((specs[0].attrs[102], specs[1].attrs[102]), (Some(1), Some(0)));
        c.apply("vmm=0", false).unwrap();
        assert_eq!(c.device_specs().unwrap()[0].attrs[102], Some(0));
    }

    #[test]
    fn peer_list_continues_across_commas() {
        let mut c = Config::default();
        c.apply("devices=3,peer=0-1,1>2,latency_us=5", false).unwrap();
        let m = c.peer_matrix();
        assert!(m[0][1] && m[1][0] && m[1][2] && !m[2][1] && !m[0][2] && !m[0][0]);
        assert_eq!(c.latency_us, 5);
    }

    #[test]
    fn rejects_bad_syntax_atomically() {
        let mut c = Config::default();
        assert!(c.apply("latency_us=7,bogus", false).is_err());
        assert!(c.apply("latency_us=7,memory=12parsecs", false).is_err());
        assert!(c.apply("dev5.memory=1GiB", false).is_err());
        assert!(c.apply("no_such_attribute=1", false).is_err());
        assert!(c.apply("unified_addressing=0", false).is_err());
        assert!(c.apply("dev0.can_use_host_pointer_for_registered_mem=0", false).is_err());
        for unexported in [
            "can_tex2d_gather=1",
            "dev1.max_access_policy_window_size=4096",
            "mem_sync_domain_count=4",
            "unified_function_pointers=1",
            "pageable_memory_access=1",
            "dev1.cooperative_launch=1",
            "multicast_supported=1",
            "dma_buf_supported=1",
            "can_use_64_bit_stream_mem_ops=1",
            "mempool_supported_handle_types=9",
            "dev1.mempool_supported_handle_types=8",
        ] {
            assert!(c.apply(unexported, false).is_err(), "{unexported}");
        }
        c.apply("can_use_host_pointer_for_registered_mem=1,dev0.unified_addressing=1", false).unwrap();
        c.apply("can_tex2d_gather=0,pageable_memory_access=0", false).unwrap();
        // Modelled capabilities stay configurable either way.
        c.apply("managed_memory=0,concurrent_managed_access=0,host_register_supported=0,vmm=0", false)
            .unwrap();
        c.apply("ipc_event_supported=0,memory_pools_supported=0,can_map_host_memory=0", false).unwrap();
        c.apply("dev1.mempool_supported_handle_types=0,mempool_supported_handle_types=1", false).unwrap();
        assert_eq!(c.latency_us, 200);
        assert!(c.apply("devices=4", true).is_err());
        c.apply("latency_us=9,leak_check=1", true).unwrap();
        assert!(c.leak_check);
    }

    /// `schedule` takes `enqueued` or `reversed` (any case), also after `cuInit`; any other value
    /// is refused like any bad value, leaving the whole specification unapplied.
    #[test]
    fn schedule_is_a_runtime_key_with_two_values() {
        let mut c = Config::default();
        assert_eq!(c.schedule, Schedule::Enqueued);
        c.apply("schedule=reversed", true).unwrap();
        assert_eq!(c.schedule, Schedule::Reversed);
        c.apply("schedule=Enqueued", true).unwrap();
        assert_eq!(c.schedule, Schedule::Enqueued);
        for bad in ["schedule=random", "schedule=", "latency_us=3,schedule=newest"] {
            assert!(c.apply(bad, true).is_err(), "{bad}");
            assert!(c.apply(bad, false).is_err(), "{bad}");
        }
        assert_eq!((c.schedule, c.latency_us), (Schedule::Enqueued, 200));
        c.apply("devices=1,schedule=reversed", false).unwrap();
        assert_eq!(c.schedule, Schedule::Reversed);
    }
}
