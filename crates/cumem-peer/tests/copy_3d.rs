//! 3D peer copies between a linked and an unlinked pair of simulated devices (`peer=0-1`):
//! the box lands bitwise, every element outside it stays as it was, and a box
//! outside either side is a typed error before anything is queued; the copy waits for the
//! source's earlier work, and freeing the source waits for the copy (gated, `#[serial]`).

use cumem_copy::StreamCopy;
use cumem_copy::{Copy3D, PitchedBuffer};
use cumem_core::{Device, Error, Stream};
use cumem_peer::{PeerPath, PeerStreamCopy3D, Topology};
use cumem_sys::testing;
use serial_test::{parallel, serial};

/// Streams on the first `n` devices, or `None` (with a message) when there are fewer.
fn streams(n: usize) -> Option<Vec<Stream>> {
    testing::init_with("devices=3,peer=0-1,latency_us=2000");
    if !testing::needs_devices(n) {
        return None;
    }
    Some((0..n).map(|d| Stream::non_blocking(&Device::get(d).unwrap().context().unwrap()).unwrap()).collect())
}

/// Random-looking words (xorshift), different per seed.
fn random(n: usize, seed: u64) -> Vec<u64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect()
}

/// Every element of a `w` × `h` × `d` pitched buffer, row by row (padding left out).
fn read(buf: &PitchedBuffer<u64>) -> Vec<u64> {
    let h = buf.height();
    (0..h * buf.depth()).flat_map(|r| buf.row_3d(r / h, r % h).unwrap().to_vec().unwrap()).collect()
}

#[test]
#[parallel]
fn a_box_lands_bitwise_and_nothing_outside_it_changes() {
    let Some(s) = streams(3) else { return };
    let topo = Topology::probe().unwrap();
    let (w, h, d) = (37, 5, 4);
    let data = random(w * h * d, 7);
    let mut src = PitchedBuffer::<u64>::zeroed_3d(&s[0], w, h, d).unwrap();
    for r in 0..h * d {
        cumem_copy::copy_h2d(&data[r * w..(r + 1) * w], &mut src.row_3d_mut(r / h, r % h).unwrap()).unwrap();
    }
    // A 20 × 3 × 2 box from (5, 1, 1) of the source to (10, 2, 0) of the destination.
    let b = Copy3D::new(20, 3, 2).src_at(5, 1, 1).dst_at(10, 2, 0);
    for (dst_dev, on) in [(1, 0), (1, 1), (2, 0), (2, 2)] {
        let mut dst = PitchedBuffer::<u64>::zeroed_3d(&s[dst_dev], w, h, d).unwrap();
        let done = s[on].copy_3d_peer(src.as_pitched(), dst.as_pitched_mut(), b).unwrap();
        let expected = if topo.linked(0, dst_dev) { PeerPath::Direct } else { PeerPath::Staged };
        assert_eq!((done.path(), done.bytes()), (expected, 20 * 3 * 2 * 8));
        let got = read(&dst);
        for z in 0..d {
            for y in 0..h {
                for x in 0..w {
                    let inside = (10..30).contains(&x) && (2..5).contains(&y) && z < 2;
                    let want = if inside { data[((z + 1) * h + (y - 1)) * w + (x - 5)] } else { 0 };
                    assert_eq!(got[(z * h + y) * w + x], want, "({x}, {y}, {z}) to device {dst_dev} on {on}");
                }
            }
        }
    }
}

#[test]
#[parallel]
fn a_box_outside_either_side_is_refused_before_anything_is_queued() {
    let Some(s) = streams(2) else { return };
    let src = PitchedBuffer::<u64>::zeroed_3d(&s[0], 8, 4, 2).unwrap();
    let mut dst = PitchedBuffer::<u64>::zeroed_3d(&s[1], 8, 4, 2).unwrap();
    cumem_copy::copy_h2d(&[1u64; 8][..], &mut dst.row_mut(0).unwrap()).unwrap();
    let before = read(&dst);
    for b in [
        Copy3D::new(9, 1, 1),                 // wider than a row
        Copy3D::new(8, 1, 1).dst_at(1, 0, 0), // past the destination's row
        Copy3D::new(8, 4, 3),                 // more slices than the source has
        Copy3D::new(8, 2, 1).src_at(0, 3, 0), // past the rows of a slice
    ] {
        let r = s[0].copy_3d_peer(src.as_pitched(), dst.as_pitched_mut(), b);
        assert!(matches!(r, Err(Error::OutOfRange { .. })), "{b:?}: {r:?}");
    }
    assert_eq!(read(&dst), before);
    // A stream of neither device.
    if let Some(s) = streams(3) {
        let r = s[2].copy_3d_peer(src.as_pitched(), dst.as_pitched_mut(), Copy3D::new(8, 4, 2));
        assert!(matches!(r, Err(Error::WrongDevice { .. })), "{r:?}");
    }
}

#[test]
#[serial] // holds a stream with a gate
fn a_3d_peer_copy_waits_for_the_sources_earlier_work_and_frees_wait_for_it() {
    let Some(s) = streams(2) else { return };
    let (w, h, d) = (16, 4, 2);
    let mut src = PitchedBuffer::<u32>::zeroed_3d(&s[0], w, h, d).unwrap();
    let mut dst = PitchedBuffer::<u32>::zeroed_3d(&s[1], w, h, d).unwrap();
    assert!(serial_test::is_locked_serially(None));
    s[0].context().bind().unwrap();
    // SAFETY: `s[0]` is alive, and its context was just made current.
    let gate = unsafe { testing::hold(s[0].raw()) };
    // Held: the fill runs only once the gate opens, and the copy on device 1's stream must wait.
    s[0].fill(&mut src.row_3d_mut(1, 2).unwrap(), 0xC0FFEE).unwrap();
    let done = s[1].copy_3d_peer(src.as_pitched(), dst.as_pitched_mut(), Copy3D::new(w, h, d)).unwrap();
    let opener = gate.release_after(std::time::Duration::from_millis(100));
    drop(src); // must wait for the copy, which waits for the fill
    opener.join().unwrap();
    let row = dst.row_3d(1, 2).unwrap().to_vec().unwrap();
    assert!(row.iter().all(|&v| v == 0xC0FFEE), "the copy ({:?}) ran before the fill: {row:?}", done.path());
    if let Some(ctl) = testing::sim_control() {
        let violations = ctl.violations_on_this_thread();
        assert!(violations.is_empty(), "{violations:?}");
    }
}
