//! The open-file limit of a process with many sockets: the server's connections
//! (`--max-connections`) and the benchmark client's requests in flight both exceed the soft limit
//! many systems start processes with (1024). The soft limit is raised to the hard one, which an
//! unprivileged process may do for itself.

/// Raises the soft open-file limit to the hard one; returns the limit now in force, if known.
pub fn raise() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
        // SAFETY: setrlimit reads the struct we pass; it raises the soft limit to the hard one.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    Some(if lim.rlim_cur == libc::RLIM_INFINITY { u64::MAX } else { lim.rlim_cur })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_soft_limit_ends_at_the_hard_one() {
        let now = super::raise().unwrap();
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes one rlimit into the struct we own.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert_eq!(lim.rlim_cur, lim.rlim_max);
        assert!(now > 0);
    }
}
