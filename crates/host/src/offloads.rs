//! Segmentation offloads (TSO, GSO) of a network interface. They are not files: on a real host
//! the ethtool ioctl answers (reading needs no privilege); a fixture tree answers from
//! `.rampart-fixture/offloads.json` (`{"eth0": {"tso": true, "gso": true}}`).

use crate::tree::HostTree;
use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
pub(crate) struct Offloads {
    pub tso: bool,
    pub gso: bool,
}

/// Why an interface's offloads are unknown.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OffloadsError {
    #[error("the fixture tree has no .rampart-fixture/offloads.json")]
    NoFixture,
    #[error(transparent)]
    FixtureRead(std::io::Error),
    #[error("offloads.json: {0}")]
    FixtureJson(#[source] serde_json::Error),
    #[error("offloads.json has no entry for {0}")]
    NoFixtureEntry(String),
    #[error("bad interface name {0:?}")]
    InterfaceName(String),
    #[error("socket: {0}")]
    Socket(#[source] std::io::Error),
    #[error("ethtool ioctl on {interface}: {source}")]
    Ioctl {
        interface: String,
        #[source]
        source: std::io::Error,
    },
}

pub(crate) fn read(tree: &HostTree, interface: &str) -> Result<Offloads, OffloadsError> {
    if !tree.is_real_host() {
        let Some(path) = tree.fixture_file("offloads.json") else {
            return Err(OffloadsError::NoFixture);
        };
        let text = std::fs::read_to_string(&path).map_err(OffloadsError::FixtureRead)?;
        let table: BTreeMap<String, Offloads> =
            serde_json::from_str(&text).map_err(OffloadsError::FixtureJson)?;
        return table
            .get(interface)
            .copied()
            .ok_or_else(|| OffloadsError::NoFixtureEntry(interface.to_string()));
    }
    Ok(Offloads {
        tso: ethtool_value(interface, ETHTOOL_GTSO)?,
        gso: ethtool_value(interface, ETHTOOL_GGSO)?,
    })
}

/// linux/ethtool.h.
const ETHTOOL_GTSO: u32 = 0x0000_001e;
const ETHTOOL_GGSO: u32 = 0x0000_0023;
/// linux/sockios.h.
const SIOCETHTOOL: libc::c_ulong = 0x8946;

/// linux/ethtool.h `struct ethtool_value`.
#[repr(C)]
struct EthtoolValue {
    cmd: u32,
    data: u32,
}

/// linux/if.h `struct ifreq`: the name, then a union whose `ifr_data` member we use; the
/// padding makes it the union's full size (24 bytes on 64-bit).
#[repr(C)]
struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    data: *mut libc::c_void,
    padding: [u8; 16],
}

fn ethtool_value(interface: &str, command: u32) -> Result<bool, OffloadsError> {
    if interface.len() >= libc::IFNAMSIZ || interface.bytes().any(|b| b == 0) {
        return Err(OffloadsError::InterfaceName(interface.to_string()));
    }
    let mut value = EthtoolValue {
        cmd: command,
        data: 0,
    };
    let mut request = IfReq {
        name: [0; libc::IFNAMSIZ],
        data: (&mut value as *mut EthtoolValue).cast(),
        padding: [0; 16],
    };
    for (slot, byte) in request.name.iter_mut().zip(interface.bytes()) {
        *slot = byte as libc::c_char;
    }
    // SAFETY: a plain datagram socket; the descriptor is closed below on every path.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    if fd < 0 {
        return Err(OffloadsError::Socket(std::io::Error::last_os_error()));
    }
    // SAFETY: SIOCETHTOOL takes a `struct ifreq*` whose ifr_data points at an ethtool command
    // struct; `request` and `value` both outlive the call.
    let rc = unsafe { libc::ioctl(fd, SIOCETHTOOL as _, &mut request as *mut IfReq) };
    let error = std::io::Error::last_os_error();
    // SAFETY: `fd` is the socket opened above, closed once.
    unsafe { libc::close(fd) };
    if rc < 0 {
        return Err(OffloadsError::Ioctl {
            interface: interface.to_string(),
            source: error,
        });
    }
    Ok(value.data != 0)
}
