//! The facade re-exports the channel crate (feature `channel`): a ring made through `cumem` alone
//! publishes what was sent where the device reads it.

#![cfg(feature = "channel")]

use cumem::channel::{Direction, RingChannel, SendStatus, TransferStrategy};
use cumem::{Device, Stream};

#[test]
fn a_ring_through_the_facade_publishes_into_device_memory() {
    cumem_sys::testing::init();
    let stream = Stream::non_blocking(&Device::get(0).unwrap().context().unwrap()).unwrap();
    let mut ch =
        RingChannel::<u32>::new(&stream, Direction::HostToDevice, 3, TransferStrategy::Sync).unwrap();
    for m in [7, 8, 9] {
        assert_eq!(ch.try_send(m).unwrap(), SendStatus::Sent);
    }
    assert_eq!(ch.try_send(10).unwrap(), SendStatus::Full);
    assert_eq!(ch.flush_to_device().unwrap(), 3);
    let side = ch.device_side();
    assert_eq!(side.slots.as_slice().to_vec().unwrap(), [7, 8, 9]);
    // head 0 (word 0), tail 3 (word 16), one publish (word 32).
    let words = side.control.as_slice().to_vec().unwrap();
    assert_eq!((words[0], words[16], words[32]), (0, 3, 1));
}
