//! Descriptor passing over a Unix socket: the received descriptor reaches the same file (bytes
//! written through it are read through the sender's), several travel in one message, and the
//! limits give typed errors. No driver involved; the binary still ends with the leak check.

use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use cumem_ipc::fd_passing::{MAX_FDS, anonymous_file, recv_fds, send_fds};

#[test]
fn a_received_descriptor_reaches_the_senders_file() {
    cumem_sys::testing::init();
    let (a, b) = UnixStream::pair().unwrap();
    let mut first = std::fs::File::from(anonymous_file("first").unwrap());
    let second = std::fs::File::from(anonymous_file("second").unwrap());
    send_fds(&a, b"2", &[first.as_fd(), second.as_fd()]).unwrap();
    let mut buf = [0u8; 4];
    let (n, fds) = recv_fds(&b, &mut buf, 8).unwrap();
    assert_eq!((n, &buf[..1], fds.len()), (1, &b"2"[..], 2));
    let mut fds = fds.into_iter();
    let mut got = std::fs::File::from(fds.next().unwrap());
    got.write_all(b"from the receiver").unwrap();
    first.seek(SeekFrom::Start(0)).unwrap();
    let mut text = String::new();
    first.read_to_string(&mut text).unwrap();
    assert_eq!(text, "from the receiver");
}

#[test]
fn limits_are_typed_errors() {
    cumem_sys::testing::init();
    let (a, b) = UnixStream::pair().unwrap();
    let file = anonymous_file("limit").unwrap();
    assert_eq!(send_fds(&a, b"", &[file.as_fd()]).unwrap_err().kind(), ErrorKind::InvalidInput);
    let many = vec![file.as_fd(); MAX_FDS + 1];
    assert_eq!(send_fds(&a, b"x", &many).unwrap_err().kind(), ErrorKind::InvalidInput);
    send_fds(&a, b"x", &[file.as_fd(), file.as_fd(), file.as_fd()]).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(recv_fds(&b, &mut buf, 1).unwrap_err().kind(), ErrorKind::InvalidData);
    drop(a);
    assert_eq!(recv_fds(&b, &mut buf, 1).unwrap().0, 0, "a closed peer reads as 0 bytes");
}
