//! Passing file descriptors between processes over a Unix socket (`SCM_RIGHTS`).
//!
//! Shareable handles of the driver (pool and VMM exports) are file descriptors, which mean
//! nothing in another process unless the kernel copies them there: [`send_fds`] attaches them to
//! a message, [`recv_fds`] receives the message and new descriptors for the same files.
//!
//! A `UnixStream` is a byte stream, not a sequence of messages, so the program frames its data:
//! one `recv_fds` can return bytes of an earlier plain send together with the descriptor-carrying
//! one (the descriptors arrive with the first byte of the send that carried them), and a send
//! that wrote only part of its data still delivered every descriptor. Send the descriptors with a
//! fixed-length header (or a length prefix) and read exactly that many bytes, or use a
//! `SOCK_SEQPACKET` socket, which keeps message boundaries.
//!
//! ```
//! use std::io::{Read, Seek, Write};
//! use std::os::fd::AsFd;
//! use std::os::unix::net::UnixStream;
//! let (a, b) = UnixStream::pair()?;
//! let mut file = std::fs::File::from(cumem_ipc::fd_passing::anonymous_file("demo")?);
//! file.write_all(b"shared")?;
//! cumem_ipc::fd_passing::send_fds(&a, b"one file", &[file.as_fd()])?;
//! let mut buf = [0u8; 16];
//! let (n, fds) = cumem_ipc::fd_passing::recv_fds(&b, &mut buf, 4)?;
//! assert_eq!(&buf[..n], b"one file");
//! let mut received = std::fs::File::from(fds.into_iter().next().unwrap());
//! received.rewind()?;
//! let mut text = String::new();
//! received.read_to_string(&mut text)?;
//! assert_eq!(text, "shared");
//! # Ok::<(), std::io::Error>(())
//! ```

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// Most descriptors one message carries (the kernel's `SCM_MAX_FD` is 253).
pub const MAX_FDS: usize = 253;

/// Sends `data` (at least one byte, so the receiver sees a message) with copies of `fds`
/// attached. On a stream socket the receiver may get `data` merged with neighbouring sends (see
/// the [module docs](self) on framing). Fails with `InvalidInput` for empty `data` or more than [`MAX_FDS`] descriptors.
pub fn send_fds(sock: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if data.is_empty() || fds.len() > MAX_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "need 1+ data bytes and at most 253 fds"));
    }
    let raw: Vec<libc::c_int> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let fd_bytes = std::mem::size_of_val(raw.as_slice());
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    // SAFETY: `msghdr` is plain data; every field used is set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` has a control buffer of `space` bytes, room for one header and `raw`.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            std::ptr::copy_nonoverlapping(raw.as_ptr().cast::<u8>(), libc::CMSG_DATA(cmsg), fd_bytes);
        }
    }
    // SAFETY: `msg` points at `iov` (over `data`) and `control`, all alive for the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if (n as usize) < data.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "the message was sent only in part"));
    }
    Ok(())
}

/// Receives one message into `buf` and up to `max_fds` descriptors sent with it (each new in
/// this process, close-on-exec, closed when dropped). Returns the data length and the
/// descriptors; a message whose descriptors did not fit fails with `InvalidData` (the kernel
/// closed the extra ones). `Ok((0, []))` means the peer closed the socket.
pub fn recv_fds(sock: &UnixStream, buf: &mut [u8], max_fds: usize) -> io::Result<(usize, Vec<OwnedFd>)> {
    let max_fds = max_fds.min(MAX_FDS);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((max_fds * std::mem::size_of::<libc::c_int>()) as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8).max(1)];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: `msghdr` is plain data; every field used is set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `iov` (over `buf`) and `control`, both alive and writable.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg`'s control buffer; the CMSG macros walk it within
    // `msg_controllen`, and every SCM_RIGHTS payload is an array of descriptors now ours.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let payload = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                for i in 0..payload / std::mem::size_of::<libc::c_int>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "more descriptors arrived than max_fds"));
    }
    Ok((n as usize, fds))
}

/// A new anonymous in-memory file (`memfd_create`), close-on-exec: something to share.
pub fn anonymous_file(name: &str) -> io::Result<OwnedFd> {
    let name = CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in name"))?;
    // SAFETY: a NUL-terminated name; the result is checked before use.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
