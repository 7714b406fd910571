//! How the processes of a data-parallel group find each other: rank 0 makes NCCL's unique id
//! and serves it over TCP at `MASTER_ADDR:MASTER_PORT`; the other ranks connect (again and
//! again until a deadline) and get it. Rank 0 answers nobody before every rank has come, so a
//! rank that never comes, a world size that differs or a rank given twice is an error on every
//! rank that came, within the deadline, instead of an NCCL initialisation that waits forever.
//!
//! The exchange, numbers little-endian: a rank sends [`MAGIC`], its world size (u32) and its
//! rank (u32); rank 0 answers [`GO`] and the id (128 bytes), or a refusal ([`MISMATCH`] or
//! [`LATE`]), the length of a message (u32) and the message (UTF-8).

use super::nccl::UNIQUE_ID_BYTES;
use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// How much longer than the group's timeout a rank waits for rank 0's answer.
const ANSWER_GRACE: Duration = Duration::from_secs(2);
const MAGIC: &[u8; 8] = b"flatnnRV";
const GO: u8 = 0;
/// The group cannot form as configured (world sizes differ, a rank is out of range or twice).
const MISMATCH: u8 = 1;
/// Some rank did not come in time.
const LATE: u8 = 2;
/// How long a waiting rank sleeps between tries to connect, and rank 0 between looks for one.
const POLL: Duration = Duration::from_millis(20);
/// How long rank 0 waits for a connection's first bytes.
const HELLO: Duration = Duration::from_secs(2);

/// Where this process stands in a group of processes that train one model together, one
/// process a GPU, as `torchrun` describes it in the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// This process's rank, in `0..world`.
    pub rank: usize,
    /// Processes in the group.
    pub world: usize,
    /// The CUDA device this process trains on: its rank among the processes of its host.
    pub local_rank: usize,
    /// `host:port` where rank 0 serves the others (it listens there; it must be an address of
    /// rank 0's host that the others reach).
    pub master: String,
    /// How long the group may take to form, and a step or a wait for one to finish, before
    /// that is an error.
    pub timeout: Duration,
}

impl Group {
    /// The default [`Group::timeout`].
    pub const TIMEOUT: Duration = Duration::from_secs(300);

    /// From `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (0 where unset), `MASTER_ADDR` and
    /// `MASTER_PORT`, with the default timeout. A missing or malformed value is an
    /// [`Error::Config`] naming it.
    pub fn from_env() -> Result<Group> {
        Group::from_vars(|name| std::env::var(name).ok())
    }

    fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Group> {
        let number = |name: &str, default: Option<usize>| -> Result<usize> {
            match (var(name), default) {
                (Some(v), _) => v.trim().parse().map_err(|_| Error::Config(format!("{name}={v:?} is not a whole number"))),
                (None, Some(d)) => Ok(d),
                (None, None) => {
                    Err(Error::Config(format!("{name} is not set (a process of a group needs RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")))
                }
            }
        };
        let (rank, world, local_rank) = (number("RANK", None)?, number("WORLD_SIZE", None)?, number("LOCAL_RANK", Some(0))?);
        if world == 0 || rank >= world {
            return Err(Error::Config(format!("RANK={rank} is not a rank of WORLD_SIZE={world}")));
        }
        let addr = var("MASTER_ADDR").ok_or_else(|| Error::Config("MASTER_ADDR is not set".into()))?;
        let port = number("MASTER_PORT", None)?;
        let port = u16::try_from(port).map_err(|_| Error::Config(format!("MASTER_PORT={port} is not a port")))?;
        // an IPv6 literal takes brackets before its port
        let master = if addr.contains(':') && !addr.starts_with('[') { format!("[{addr}]:{port}") } else { format!("{addr}:{port}") };
        Ok(Group { rank, world, local_rank, master, timeout: Group::TIMEOUT })
    }
}

/// Rank 0: serves `id` to every other rank of `group`, answering them all once all have come.
pub(crate) fn serve(group: &Group, id: &[u8; UNIQUE_ID_BYTES]) -> Result<()> {
    let deadline = Instant::now() + group.timeout;
    let listener = TcpListener::bind(&group.master).map_err(|e| io(group, e))?;
    listener.set_nonblocking(true).map_err(|e| io(group, e))?;
    let mut came: Vec<(usize, TcpStream)> = Vec::new();
    while came.len() + 1 < group.world {
        let mut stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(POLL);
                continue;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let missing: Vec<String> = (1..group.world).filter(|r| !came.iter().any(|(c, _)| c == r)).map(|r| r.to_string()).collect();
                let what = format!(
                    "rank(s) {} of {} did not come to {} within {:?}",
                    missing.join(", "),
                    group.world,
                    group.master,
                    group.timeout
                );
                refuse_all(&mut came, LATE, &what);
                return Err(io(group, std::io::Error::new(ErrorKind::TimedOut, what)));
            }
            Err(e) => return Err(io(group, e)),
        };
        // something that is not a rank (or a rank that hung up) is dropped; the rest wait
        let Ok((world, rank)) = hello(&mut stream, deadline) else { continue };
        let problem = if world != group.world {
            Some(format!("rank {rank} has WORLD_SIZE={world}, rank 0 has {}", group.world))
        } else if rank == 0 || rank >= world {
            Some(format!("a process came as rank {rank} of {world} (rank 0 serves the others)"))
        } else if came.iter().any(|(r, _)| *r == rank) {
            Some(format!("two processes came as rank {rank}"))
        } else {
            None
        };
        if let Some(what) = problem {
            let _ = refuse(&mut stream, MISMATCH, &what);
            refuse_all(&mut came, MISMATCH, &what);
            return Err(Error::Config(format!("the group at {} cannot form: {what}", group.master)));
        }
        came.push((rank, stream));
    }
    for (rank, stream) in &mut came {
        let sent = stream.write_all(&[GO]).and_then(|()| stream.write_all(id));
        sent.map_err(|e| io(group, std::io::Error::new(e.kind(), format!("rank {rank} left before it got the id: {e}"))))?;
    }
    Ok(())
}

/// Rank `group.rank` (not 0): the id rank 0 serves, once every rank has come.
pub(crate) fn fetch(group: &Group) -> Result<[u8; UNIQUE_ID_BYTES]> {
    let deadline = Instant::now() + group.timeout;
    let mut stream = loop {
        let tried = group.master.to_socket_addrs().and_then(|mut addrs| {
            let addr = addrs.next().ok_or_else(|| std::io::Error::new(ErrorKind::NotFound, "no address"))?;
            TcpStream::connect_timeout(&addr, POLL.max(Duration::from_millis(100)))
        });
        match tried {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(POLL),
            Err(e) => {
                let what = format!("rank {}: no rank 0 answered at {} within {:?} ({e})", group.rank, group.master, group.timeout);
                return Err(io(group, std::io::Error::new(ErrorKind::TimedOut, what)));
            }
        }
    };
    let rank_error = |e: std::io::Error| {
        let what = format!("rank {}: rank 0 did not hand out the id ({e})", group.rank);
        io(group, std::io::Error::new(e.kind(), what))
    };
    let mut hello = Vec::with_capacity(16);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&u32_of(group.world)?.to_le_bytes());
    hello.extend_from_slice(&u32_of(group.rank)?.to_le_bytes());
    stream.write_all(&hello).map_err(rank_error)?;
    // rank 0 answers within its timeout of starting to listen, which was before this connect;
    // the grace lets its answer (which names the ranks that did not come) arrive on a busy
    // machine before this rank gives up with a less useful error of its own
    set_deadline(&stream, Instant::now() + group.timeout + ANSWER_GRACE).map_err(rank_error)?;
    let mut answer = [0u8; 1];
    stream.read_exact(&mut answer).map_err(rank_error)?;
    if answer[0] == GO {
        let mut id = [0u8; UNIQUE_ID_BYTES];
        stream.read_exact(&mut id).map_err(rank_error)?;
        return Ok(id);
    }
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(rank_error)?;
    let mut message = vec![0u8; u32::from_le_bytes(len).min(4096) as usize];
    stream.read_exact(&mut message).map_err(rank_error)?;
    let what = format!("rank {}: rank 0 refused: {}", group.rank, String::from_utf8_lossy(&message));
    Err(match answer[0] {
        LATE => io(group, std::io::Error::new(ErrorKind::TimedOut, what)),
        _ => Error::Config(what),
    })
}

/// A rank's (world, rank), read before `deadline` and within [`HELLO`] (a rank sends it as
/// soon as it connects; something else at the port must not hold rank 0 up).
fn hello(stream: &mut TcpStream, deadline: Instant) -> std::io::Result<(usize, usize)> {
    stream.set_nonblocking(false)?;
    set_deadline(stream, deadline.min(Instant::now() + HELLO))?;
    let mut bytes = [0u8; 16];
    stream.read_exact(&mut bytes)?;
    if &bytes[..8] != MAGIC {
        return Err(std::io::Error::new(ErrorKind::InvalidData, "not a flatnn rank"));
    }
    let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
    Ok((word(8), word(12)))
}

/// Reads on `stream` fail once `deadline` has passed.
fn set_deadline(stream: &TcpStream, deadline: Instant) -> std::io::Result<()> {
    stream.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
}

fn refuse(stream: &mut TcpStream, code: u8, what: &str) -> std::io::Result<()> {
    let len = u32::try_from(what.len()).unwrap_or(u32::MAX);
    stream.write_all(&[code])?;
    stream.write_all(&len.to_le_bytes())?;
    stream.write_all(what.as_bytes())
}

/// Tells every rank that came why the group will not form (a rank already gone is skipped).
fn refuse_all(came: &mut [(usize, TcpStream)], code: u8, what: &str) {
    for (_, stream) in came {
        let _ = refuse(stream, code, what);
    }
}

fn u32_of(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Config(format!("{n} is more ranks than a group holds")))
}

/// An [`Error::Io`] at the group's address.
fn io(group: &Group, source: std::io::Error) -> Error {
    Error::Io { path: group.master.clone().into(), source }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    /// A group of `world` at a port free a moment ago, on the loopback address.
    fn group(world: usize, timeout: Duration) -> Group {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        Group { rank: 0, world, local_rank: 0, master: format!("127.0.0.1:{port}"), timeout }
    }

    fn id() -> [u8; UNIQUE_ID_BYTES] {
        std::array::from_fn(|i| (i * 7 + 3) as u8)
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let g = group(4, Duration::from_secs(20));
        let ranks: Vec<_> = (1..4)
            .map(|rank| {
                thread::spawn({
                    let g = Group { rank, ..g.clone() };
                    move || fetch(&g)
                })
            })
            .collect();
        serve(&g, &id()).unwrap();
        for rank in ranks {
            assert_eq!(rank.join().unwrap().unwrap(), id());
        }
    }

    #[test]
    fn ranks_may_come_before_rank_zero_listens() {
        let g = group(2, Duration::from_secs(20));
        let early = thread::spawn({
            let g = Group { rank: 1, ..g.clone() };
            move || fetch(&g)
        });
        thread::sleep(Duration::from_millis(300));
        serve(&g, &id()).unwrap();
        assert_eq!(early.join().unwrap().unwrap(), id());
    }

    #[test]
    fn a_mismatched_world_size_is_an_error_on_both_sides_at_once() {
        let g = group(2, Duration::from_secs(20));
        let start = Instant::now();
        let other = thread::spawn({
            let g = Group { rank: 1, world: 3, ..g.clone() };
            move || fetch(&g)
        });
        let served = serve(&g, &id()).unwrap_err();
        let fetched = other.join().unwrap().unwrap_err();
        assert!(matches!(&served, Error::Config(m) if m.contains("WORLD_SIZE=3")), "{served}");
        assert!(matches!(&fetched, Error::Config(m) if m.contains("WORLD_SIZE=3")), "{fetched}");
        assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    }

    #[test]
    fn a_rank_twice_is_an_error() {
        let g = group(3, Duration::from_secs(20));
        let twins: Vec<_> = (0..2)
            .map(|_| {
                thread::spawn({
                    let g = Group { rank: 1, ..g.clone() };
                    move || fetch(&g)
                })
            })
            .collect();
        let served = serve(&g, &id()).unwrap_err();
        assert!(served.to_string().contains("two processes came as rank 1"), "{served}");
        for twin in twins {
            assert!(twin.join().unwrap().is_err());
        }
    }

    #[test]
    fn a_rank_that_never_comes_is_an_error_after_the_deadline_on_every_rank_that_came() {
        let g = group(3, Duration::from_millis(700));
        let start = Instant::now();
        let came = thread::spawn({
            let g = Group { rank: 2, ..g.clone() };
            move || fetch(&g)
        });
        let served = serve(&g, &id()).unwrap_err();
        let elapsed = start.elapsed();
        assert!(matches!(&served, Error::Io { source, .. } if source.kind() == ErrorKind::TimedOut), "{served}");
        assert!(served.to_string().contains("rank(s) 1 of 3 did not come"), "{served}");
        assert!(elapsed >= Duration::from_millis(700) && elapsed < Duration::from_secs(10), "{elapsed:?}");
        let fetched = came.join().unwrap().unwrap_err();
        assert!(fetched.to_string().contains("did not come"), "{fetched}");
    }

    #[test]
    fn no_rank_zero_is_an_error_after_the_deadline() {
        let g = Group { rank: 1, ..group(2, Duration::from_millis(500)) };
        let start = Instant::now();
        let err = fetch(&g).unwrap_err();
        assert!(err.to_string().contains("no rank 0 answered"), "{err}");
        assert!(start.elapsed() >= Duration::from_millis(500) && start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_stranger_at_the_port_is_ignored() {
        let g = group(2, Duration::from_secs(20));
        let ranks = thread::spawn({
            let g = Group { rank: 1, ..g.clone() };
            move || {
                // something that is not a rank connects, writes garbage and hangs up first
                let addr = g.master.to_socket_addrs().unwrap().next().unwrap();
                let connect = || loop {
                    if let Ok(s) = TcpStream::connect(addr) {
                        break s;
                    }
                    thread::sleep(POLL);
                };
                connect().write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
                fetch(&g)
            }
        });
        serve(&g, &id()).unwrap();
        assert_eq!(ranks.join().unwrap().unwrap(), id());
    }

    #[test]
    fn the_group_comes_from_torchruns_variables() {
        fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
            let pairs: Vec<(String, String)> = pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
            move |name| pairs.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
        }
        let g = Group::from_vars(vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.5"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(g, Group { rank: 1, world: 2, local_rank: 1, master: "10.0.0.5:29500".into(), timeout: Group::TIMEOUT });
        let g = Group::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "::1"), ("MASTER_PORT", "29500")])).unwrap();
        assert_eq!((g.local_rank, g.master.as_str()), (0, "[::1]:29500"));
        for (bad, says) in [
            (&[("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")][..], "RANK is not set"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")][..], "RANK=2 is not a rank"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")][..], "RANK=\"x\""),
            (&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")][..], "MASTER_ADDR"),
            (&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "70000")][..], "not a port"),
        ] {
            let err = Group::from_vars(vars(bad)).unwrap_err();
            assert!(matches!(&err, Error::Config(m) if m.contains(says)), "{err} should say {says}");
        }
    }
}
