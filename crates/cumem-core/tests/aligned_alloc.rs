//! Device allocations at a requested alignment, on any resource.

use std::sync::Arc;

use cumem_core::{Device, DeviceBuffer, DriverResource, Error, Feature, MAX_ALIGNMENT, Stream};
use cumem_sys::testing;

fn setup() -> (Stream, Arc<DriverResource>) {
    testing::init();
    let stream = Stream::new(&Device::get(0).unwrap().context().unwrap()).unwrap();
    let resource = Arc::new(DriverResource::new(stream.context()));
    (stream, resource)
}

#[test]
fn every_power_of_two_up_to_the_maximum_is_honoured() {
    let (stream, resource) = setup();
    let ctl = testing::sim_control();
    // The ids of the blocks holding the buffers: once freed, their addresses may be reused.
    let mut blocks = Vec::new();
    let mut align = 1;
    while align <= MAX_ALIGNMENT {
        // Several live buffers at once, of sizes that do not round to the alignment, so that a
        // lucky base address cannot pass for an aligned one.
        let bufs: Vec<DeviceBuffer<u8>> = (0..3)
            .map(|i| DeviceBuffer::zeroed_aligned_in(&resource, &stream, 100 + 7 * i, align).unwrap())
            .collect();
        for buf in &bufs {
            assert_eq!(buf.device_ptr() % align as u64, 0, "align {align}: {:#x}", buf.device_ptr());
            assert_eq!(buf.alignment(), Some(align.max(1)));
            if let Some(ctl) = &ctl {
                let live = ctl.live_report();
                let block = live.allocation_containing(buf.device_ptr());
                blocks.push(
                    block
                        .unwrap_or_else(|| panic!("{:#x} is in no allocation:\n{live}", buf.device_ptr()))
                        .id,
                );
            }
        }
        align *= 2;
    }
    if let Some(ctl) = ctl {
        // Over-allocated blocks were freed through their base address.
        let report = ctl.live_report();
        assert!(blocks.iter().all(|&id| !report.contains_allocation(id)), "{report}");
        let v = ctl.violations_on_this_thread();
        assert!(v.is_empty(), "{v:?}");
    }
}

#[test]
fn aligned_buffers_round_trip_bitwise() {
    let (stream, resource) = setup();
    let data: Vec<u64> = (0..1000u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    for align in [256, 512, 4096] {
        let buf = DeviceBuffer::from_slice_aligned_in(&resource, &stream, &data, align).unwrap();
        assert_eq!(buf.device_ptr() % align as u64, 0);
        assert_eq!(buf.to_vec().unwrap(), data);
        let z = DeviceBuffer::<u32>::zeroed_aligned(&stream, 333, align).unwrap();
        assert_eq!((z.device_ptr() % align as u64, z.to_vec().unwrap()), (0, vec![0; 333]));
        let n = DeviceBuffer::<u16>::new_aligned_in(&resource, &stream, 5, align).unwrap();
        assert_eq!(n.device_ptr() % align as u64, 0);
    }
    // The type's own alignment wins when larger than the one requested.
    let wide = DeviceBuffer::<u64>::zeroed_aligned_in(&resource, &stream, 3, 2).unwrap();
    assert_eq!(wide.alignment(), Some(8));
    // Empty buffers allocate nothing, whatever the alignment.
    let empty = DeviceBuffer::<u8>::zeroed_aligned_in(&resource, &stream, 0, 4096).unwrap();
    assert_eq!((empty.device_ptr(), empty.alignment()), (0, None));
}

#[test]
fn bad_alignments_are_errors_by_variant() {
    let (stream, resource) = setup();
    let err = DeviceBuffer::<u8>::zeroed_aligned_in(&resource, &stream, 64, 0).unwrap_err();
    assert!(matches!(err, Error::ZeroSize { what: "alignment" }), "0: {err}");
    for bad in [3, 384, 1000] {
        let err = DeviceBuffer::<u8>::zeroed_aligned_in(&resource, &stream, 64, bad).unwrap_err();
        assert!(matches!(&err, Error::InvalidValue { ctx } if ctx.bytes == Some(bad)), "{bad}: {err}");
        assert!(err.to_string().contains("not a power of two"), "{bad}: {err}");
    }
    let err = DeviceBuffer::<u8>::zeroed_aligned_in(&resource, &stream, 64, MAX_ALIGNMENT * 2).unwrap_err();
    assert!(
        matches!(err, Error::NotSupported { feature: Feature::Alignment(a), .. } if a == MAX_ALIGNMENT * 2)
    );
    assert!(matches!(
        DeviceBuffer::<u64>::zeroed_aligned(&stream, usize::MAX / 4, 512),
        Err(Error::SizeOverflow { .. })
    ));
}
