//! What every device resource must do for `DeviceBuffer`, as a table (rstest): a row per
//! resource (the driver, the driver's default and a created pool, the caching pool) alone and
//! wrapped in the statistics adaptor, so that a new resource is tested by adding a row to
//! [`every_resource`]. Data round-trips bitwise through every constructor, view and copy; errors come
//! by variant and change nothing; buffers freed on another thread return their memory; and at the
//! end of each case the resource holds nothing and the simulator's live report has none of its
//! memory. No test here holds a stream, yet every case is `#[serial]`: that last check would fail
//! when a case running beside it reused a freed address (the default pool, and the simulator's
//! address space after a while, hand out freed addresses again).

use std::sync::Arc;

use cumem_copy::{StreamCopy, copy_d2d, copy_d2h, copy_h2d};
use cumem_core::{
    AllocLayout, Context, Device, DeviceBuffer, DeviceResource, DriverResource, Error, PinnedBuffer, Stream,
};
use cumem_pool::{
    CachingResource, MemPool, MemPoolOptions, NativePoolResource, PoolConfig, StatisticsResource,
};
use cumem_sys::testing;
use rstest::rstest;
use serial_test::serial;

/// Streams start work 20 ms late, so a missing wait reads stale data.
const SIM: &str = "devices=2,latency_us=20000";

/// The resources under test.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// `DriverResource`: `cuMemAlloc`/`cuMemFree`.
    Driver,
    /// `NativePoolResource` over the device's default pool (shared with the rest of the process).
    NativeDefault,
    /// `NativePoolResource` over a pool of its own.
    NativeCreated,
    /// `CachingResource` over the driver.
    Caching,
}

/// Makes each test inside it an rstest with one case per resource: the rows of every table in
/// this file. A new resource is a new row here (and an arm in [`Row::new`]).
macro_rules! every_resource {
    ($($item:item)*) => {$(
        #[rstest]
        #[case::driver(Kind::Driver, false)]
        #[case::native_default_pool(Kind::NativeDefault, false)]
        #[case::native_created_pool(Kind::NativeCreated, false)]
        #[case::caching(Kind::Caching, false)]
        #[case::statistics_over_driver(Kind::Driver, true)]
        #[case::statistics_over_native_default_pool(Kind::NativeDefault, true)]
        #[case::statistics_over_native_created_pool(Kind::NativeCreated, true)]
        #[case::statistics_over_caching(Kind::Caching, true)]
        #[serial] // checks that its addresses are no longer live, which a parallel case could reuse
        $item
    )*};
}

/// One row: the resource buffers allocate from, and handles to observe it by.
struct Row {
    ctx: Context,
    resource: Arc<dyn DeviceResource>,
    stats: Option<Arc<StatisticsResource>>,
    caching: Option<Arc<CachingResource>>,
    /// A pool of its own, so its usage is exact (the default pool is shared with other tests).
    own_pool: Option<Arc<NativePoolResource>>,
}

impl Row {
    fn new(kind: Kind, with_statistics: bool, ordinal: usize) -> Row {
        testing::init_with(SIM);
        let ctx = Device::get(ordinal).unwrap().context().unwrap();
        let (mut caching, mut own_pool) = (None, None);
        let inner: Arc<dyn DeviceResource> = match kind {
            Kind::Driver => Arc::new(DriverResource::new(&ctx)),
            Kind::NativeDefault | Kind::NativeCreated => {
                let created = matches!(kind, Kind::NativeCreated);
                let r = Arc::new(if created {
                    NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap())
                } else {
                    NativePoolResource::default_pool(&ctx).unwrap()
                });
                if created {
                    own_pool = Some(r.clone());
                }
                r
            }
            Kind::Caching => {
                let r = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
                caching = Some(r.clone());
                r
            }
        };
        let (resource, stats): (Arc<dyn DeviceResource>, _) = if with_statistics {
            let stats = Arc::new(StatisticsResource::new(inner));
            (stats.clone(), Some(stats))
        } else {
            (inner, None)
        };
        Row { ctx, resource, stats, caching, own_pool }
    }

    /// How many buffers the resource (or its statistics) counts as live, where it can tell.
    fn live_count(&self) -> Option<i64> {
        let stats = self.stats.as_ref().map(|s| s.counters().current_count);
        let caching = self.caching.as_ref().map(|c| c.stats().current_count as i64);
        assert!(stats.is_none() || caching.is_none() || stats == caching, "{stats:?} vs {caching:?}");
        stats.or(caching)
    }

    /// Once every buffer of the case is dropped: the resource counts nothing live, and after its
    /// cache is released the simulator has none of `ptrs` (nor the caching pool's segments) live.
    fn assert_everything_returned(&self, ptrs: &[u64]) {
        // Frees are stream-ordered on each buffer's last stream: let them run.
        self.ctx.synchronize().unwrap();
        if let Some(stats) = &self.stats {
            let c = stats.counters();
            assert_eq!((c.current_bytes, c.current_count), (0, 0), "statistics: {c:?}");
        }
        let mut segments = vec![];
        if let Some(caching) = &self.caching {
            let s = caching.stats();
            assert_eq!((s.current_bytes, s.current_count), (0, 0), "caching pool: {s:?}");
            segments = caching.pool().segments();
            caching.trim().unwrap();
            assert_eq!(caching.stats().reserved_bytes, 0);
        }
        if let Some(native) = &self.own_pool {
            assert_eq!(native.pool().usage().unwrap().used_current, 0);
            native.pool().trim_to(0).unwrap();
            assert_eq!(native.pool().usage().unwrap().reserved_current, 0);
        }
        if let Some(ctl) = testing::sim_control() {
            let report = ctl.live_report();
            for &p in ptrs.iter().chain(segments.iter().map(|(base, _)| base)) {
                assert!(!report.contains_ptr(p), "{p:#x} is still live: {report}");
            }
        }
    }
}

fn pattern(n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect()
}

every_resource! {
    /// Every constructor, view and copy direction moves data bitwise; each buffer keeps its
    /// resource; the resource's counts follow the live buffers.
    fn data_round_trips_bitwise_through_every_constructor_view_and_copy(
        #[case] kind: Kind,
        #[case] with_statistics: bool,
    ) {
        const N: usize = 5000;
        let row = Row::new(kind, with_statistics, 0);
        let (r, ctx) = (&row.resource, &row.ctx);
        let stream = Stream::non_blocking(ctx).unwrap();
        let data = pattern(N);
        let mut ptrs = vec![];

        let fresh = DeviceBuffer::<u64>::new_in(r, &stream, N).unwrap();
        assert_eq!((fresh.len(), fresh.bytes()), (N, 8 * N));
        assert!(Arc::ptr_eq(fresh.resource(), r));
        let zeroed = DeviceBuffer::<u64>::zeroed_in(r, &stream, N).unwrap();
        assert_eq!(zeroed.to_vec().unwrap(), vec![0; N]);
        let mut a = DeviceBuffer::from_slice_in(r, &stream, &data).unwrap();
        assert_eq!(a.to_vec().unwrap(), data);
        assert_eq!(row.live_count().unwrap_or(3), 3);
        ptrs.extend([fresh.device_ptr(), zeroed.device_ptr(), a.device_ptr()]);

        // Blocking copies: host to device, device to device, device to host.
        let mut b = fresh;
        copy_h2d(&data, &mut b).unwrap();
        let mut c = zeroed;
        copy_d2d(&b, &mut c).unwrap();
        let mut out = vec![0u64; N];
        copy_d2h(&c, &mut out).unwrap();
        assert_eq!(out, data);

        // Queued copies through page-locked memory, read back through the host's own wait.
        let reversed: Vec<u64> = data.iter().rev().copied().collect();
        let host = PinnedBuffer::from_slice(ctx, &reversed).unwrap();
        stream.copy_h2d(&host, &mut b).unwrap();
        stream.copy_d2d(&b, &mut c).unwrap();
        let mut back = PinnedBuffer::<u64>::zeroed(ctx, N).unwrap();
        stream.copy_d2h(&c, &mut back).unwrap();
        assert_eq!(back.as_slice().unwrap(), &reversed[..]);
        let mut words = DeviceBuffer::<u32>::zeroed_in(r, &stream, 64).unwrap();
        stream.fill(&mut words, 0xC0FF_EE00).unwrap();
        assert_eq!(words.to_vec().unwrap(), vec![0xC0FF_EE00; 64]);
        ptrs.push(words.device_ptr());

        // Views read and write the part they name.
        assert_eq!(a.slice(10..20).unwrap().to_vec().unwrap(), data[10..20]);
        let (left, right) = a.split_at(1000).unwrap();
        assert_eq!((left.to_vec().unwrap(), right.to_vec().unwrap()), (data[..1000].to_vec(), data[1000..].to_vec()));
        let chunks: Vec<Vec<u64>> = a.chunks(2048).unwrap().map(|c| c.to_vec().unwrap()).collect();
        assert_eq!(chunks, [data[..2048].to_vec(), data[2048..4096].to_vec(), data[4096..].to_vec()]);
        copy_h2d(&[7, 8, 9], &mut a.slice_mut(100..103).unwrap()).unwrap();
        stream.copy_d2d(&b.slice(0..2).unwrap(), &mut a.slice_mut(4998..).unwrap()).unwrap();
        let mut expected = data.clone();
        expected[100..103].copy_from_slice(&[7, 8, 9]);
        expected[4998..].copy_from_slice(&reversed[..2]);
        assert_eq!(a.to_vec().unwrap(), expected);

        drop((a, b, c, words));
        row.assert_everything_returned(&ptrs);
    }
}

every_resource! {
    /// Bad requests are errors by variant, before anything is allocated or written; larger
    /// alignments are honoured.
    fn errors_come_by_variant_and_change_nothing(#[case] kind: Kind, #[case] with_statistics: bool) {
        let row = Row::new(kind, with_statistics, 0);
        let r = &row.resource;
        let stream = Stream::non_blocking(&row.ctx).unwrap();

        // Zero-length buffers allocate nothing.
        let empty = DeviceBuffer::<u64>::zeroed_in(r, &stream, 0).unwrap();
        assert!(empty.is_empty());
        assert_eq!((empty.device_ptr(), empty.to_vec().unwrap()), (0, vec![]));
        assert_eq!(DeviceBuffer::<u64>::from_slice_in(r, &stream, &[]).unwrap().device_ptr(), 0);
        assert_eq!(row.live_count().unwrap_or(0), 0, "an empty buffer is not an allocation");
        assert!(matches!(r.allocate(AllocLayout { bytes: 0, align: 8 }, &stream), Err(Error::ZeroSize { .. })));

        // Out of range views and mismatched copies write nothing.
        let mut buf = DeviceBuffer::from_slice_in(r, &stream, &[5u8; 10]).unwrap();
        assert!(matches!(buf.slice(5..11), Err(Error::OutOfRange { start: 5, end: 11, len: 10 })));
        assert!(matches!(buf.split_at(11), Err(Error::OutOfRange { .. })));
        assert!(matches!(buf.slice_mut(..=10), Err(Error::OutOfRange { .. })));
        assert!(matches!(buf.chunks(0), Err(Error::ZeroSize { .. })));
        assert!(matches!(copy_h2d(&[1u8; 11], &mut buf), Err(Error::LengthMismatch { expected: 10, actual: 11 })));
        assert!(matches!(copy_d2h(&buf, &mut [0u8; 9]), Err(Error::LengthMismatch { expected: 9, actual: 10 })));
        assert_eq!(buf.to_vec().unwrap(), [5; 10]);

        // Sizes that overflow, and more than the device has.
        assert!(matches!(
            DeviceBuffer::<u64>::zeroed_in(r, &stream, usize::MAX / 4),
            Err(Error::SizeOverflow { elem_size: 8, .. })
        ));
        let total = row.ctx.device().total_memory().unwrap();
        let err = DeviceBuffer::<u8>::new_in(r, &stream, total + 1).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
        assert_eq!(row.live_count().unwrap_or(1), 1, "failed requests count nothing");

        // A stream of another device is refused.
        if testing::needs_devices(2) {
            let other = Stream::non_blocking(&Device::get(1).unwrap().context().unwrap()).unwrap();
            assert!(matches!(
                DeviceBuffer::<u8>::zeroed_in(r, &other, 8),
                Err(Error::WrongDevice { expected: 0, actual: 1 })
            ));
        }

        // Larger alignments than the resource's own are honoured.
        let mut ptrs = vec![buf.device_ptr()];
        for align in [512usize, 4096] {
            let aligned = DeviceBuffer::<u8>::zeroed_aligned_in(r, &stream, 100, align).unwrap();
            assert_eq!(aligned.device_ptr() % align as u64, 0, "align {align}");
            assert_eq!(aligned.to_vec().unwrap(), vec![0; 100]);
            let layout = AllocLayout::new(100, align).unwrap();
            let p = r.allocate(layout, &stream).unwrap();
            assert_eq!(p.ptr % align as u64, 0);
            // SAFETY: allocated just above with this layout on this stream, unused.
            unsafe { r.deallocate(p, layout, &stream) };
            ptrs.extend([aligned.device_ptr(), p.ptr]);
        }
        drop(buf);
        row.assert_everything_returned(&ptrs);
    }
}

every_resource! {
    /// A buffer dropped on a thread that never touched CUDA returns its memory, with no misuse.
    fn buffers_freed_on_another_thread_return_their_memory(#[case] kind: Kind, #[case] with_statistics: bool) {
        let row = Row::new(kind, with_statistics, 0);
        let stream = Stream::non_blocking(&row.ctx).unwrap();
        let bufs: Vec<DeviceBuffer<u32>> = (1..=4)
            .map(|i| DeviceBuffer::from_slice_in(&row.resource, &stream, &vec![i; 1000 * i as usize]).unwrap())
            .collect();
        let ptrs: Vec<u64> = bufs.iter().map(DeviceBuffer::device_ptr).collect();
        assert_eq!(row.live_count().unwrap_or(4), 4);
        if let Some(stats) = &row.stats {
            assert_eq!(stats.counters().current_bytes, 4 * (1000 + 2000 + 3000 + 4000));
        }
        let violations = std::thread::spawn(move || {
            for (i, buf) in bufs.into_iter().enumerate() {
                assert_eq!(buf.to_vec().unwrap(), vec![i as u32 + 1; 1000 * (i + 1)]);
                drop(buf);
            }
            testing::sim_control().map(|ctl| ctl.violations_on_this_thread())
        })
        .join()
        .unwrap();
        assert!(violations.unwrap_or_default().is_empty());
        assert_eq!(row.live_count().unwrap_or(0), 0);
        row.assert_everything_returned(&ptrs);
    }
}
