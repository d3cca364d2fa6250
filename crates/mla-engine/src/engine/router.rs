//! Where a new request goes: to the rank (or replica) with the least work, counted in tokens a
//! request may hold (`n · (prompt + max_tokens)`), not in requests, so one long prompt weighs as
//! much as the many short ones it displaces.

/// The index of the smallest load; ties go to the lowest index so routing is deterministic.
/// Entries that are `None` (a replica that stopped) are never chosen; `None` when all are.
pub(crate) fn least_loaded_of(loads: impl IntoIterator<Item = Option<u64>>) -> Option<usize> {
    let mut best: Option<(usize, u64)> = None;
    for (i, load) in loads.into_iter().enumerate() {
        if let Some(l) = load {
            if best.is_none_or(|(_, b)| l < b) {
                best = Some((i, l));
            }
        }
    }
    best.map(|(i, _)| i)
}

/// `least_loaded_of` over ranks that are all alive. Panics on an empty slice (a caller bug: an
/// engine has at least one rank).
pub(crate) fn least_loaded(loads: &[u64]) -> usize {
    least_loaded_of(loads.iter().map(|&l| Some(l))).expect("an engine has at least one rank")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_smallest_load_and_the_lowest_index_on_ties() {
        assert_eq!(least_loaded(&[5]), 0);
        assert_eq!(least_loaded(&[7, 3, 9]), 1);
        assert_eq!(least_loaded(&[4, 4, 4]), 0);
        assert_eq!(least_loaded(&[9, 2, 2, 1, 1]), 3);
    }

    #[test]
    fn skips_stopped_replicas() {
        assert_eq!(least_loaded_of([None, Some(10), Some(3)]), Some(2));
        assert_eq!(least_loaded_of([Some(0), None]), Some(0));
        assert_eq!(least_loaded_of([None, None]), None);
        assert_eq!(least_loaded_of(Vec::<Option<u64>>::new()), None);
    }

    /// Requests of equal cost spread round-robin; a heavy one is balanced by several light ones.
    #[test]
    fn routing_by_tokens_balances_uneven_requests() {
        let mut loads = vec![0u64; 2];
        for cost in [1000, 100, 100, 100, 100] {
            let r = least_loaded(&loads);
            loads[r] += cost;
        }
        assert_eq!(loads, vec![1000, 400]);
        let mut loads = vec![0u64; 4];
        for _ in 0..8 {
            let r = least_loaded(&loads);
            loads[r] += 10;
        }
        assert_eq!(loads, vec![20; 4]);
    }
}
