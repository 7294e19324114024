//! Routing census ([`crate::Engine::set_route_census`]): which (layer, expert) units the rows
//! of each forward call route to. A batched decode step of B sequences reads every distinct
//! unit its B tokens chose once, so the distinct count per layer is what the step's
//! bandwidth bound is made of (`ds4-bench --batch`, docs/server.md §12). Counting reads the
//! router's ids back to the host after every layer, so it is for measuring runs only.

/// Counts gathered over the forward calls since the census was turned on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteCensus {
    /// Forward calls counted.
    pub calls: u64,
    /// Per layer: the distinct experts each call's rows chose, summed over the calls.
    pub distinct: Vec<u64>,
    /// Per layer and expert: the (row, slot) assignments that chose it, over the calls.
    pub load: Vec<Vec<u64>>,
}

impl RouteCensus {
    /// An empty census of `n_layer` layers of `n_expert` experts.
    pub fn new(n_layer: usize, n_expert: usize) -> RouteCensus {
        RouteCensus {
            calls: 0,
            distinct: vec![0; n_layer],
            load: vec![vec![0; n_expert]; n_layer],
        }
    }

    /// Counts one call's expert ids at layer `il` (`ids`: every row's chosen experts). An
    /// id outside the layer's experts (or a layer outside the census) is not counted.
    pub fn record(&mut self, il: usize, ids: &[i32]) {
        let (Some(load), Some(distinct)) = (self.load.get_mut(il), self.distinct.get_mut(il))
        else {
            return;
        };
        let mut seen = vec![false; load.len()];
        for &id in ids {
            let Some(e) = usize::try_from(id).ok().filter(|&e| e < load.len()) else {
                continue;
            };
            load[e] += 1;
            if !seen[e] {
                seen[e] = true;
                *distinct += 1;
            }
        }
    }

    /// Per layer, the mean distinct experts of one call (0 before any call).
    pub fn mean_distinct(&self) -> Vec<f64> {
        self.distinct
            .iter()
            .map(|&d| {
                if self.calls == 0 {
                    0.0
                } else {
                    d as f64 / self.calls as f64
                }
            })
            .collect()
    }

    /// How uneven the experts' use is: per layer the most used expert's assignments over
    /// the mean (1 = every expert equally used), averaged over the layers that routed
    /// anything. The figure load-balancing papers report as max/mean load ("MaxVio" + 1).
    pub fn max_over_mean(&self) -> f64 {
        let ratios: Vec<f64> = self
            .load
            .iter()
            .filter_map(|l| {
                let total: u64 = l.iter().sum();
                let max = *l.iter().max()?;
                (total > 0).then(|| max as f64 * l.len() as f64 / total as f64)
            })
            .collect();
        if ratios.is_empty() {
            0.0
        } else {
            ratios.iter().sum::<f64>() / ratios.len() as f64
        }
    }

    /// The share of all assignments taken by the most used `frac` of each layer's experts
    /// (at least one), averaged over the layers that routed anything: `frac` itself when
    /// every expert is equally used.
    pub fn top_share(&self, frac: f64) -> f64 {
        let shares: Vec<f64> = self
            .load
            .iter()
            .filter_map(|l| {
                let total: u64 = l.iter().sum();
                if total == 0 {
                    return None;
                }
                let mut sorted = l.clone();
                sorted.sort_unstable_by(|a, b| b.cmp(a));
                let n = ((l.len() as f64 * frac).ceil() as usize).clamp(1, l.len());
                Some(sorted[..n].iter().sum::<u64>() as f64 / total as f64)
            })
            .collect();
        if shares.is_empty() {
            0.0
        } else {
            shares.iter().sum::<f64>() / shares.len() as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_units_and_load_are_counted_per_call_and_layer() {
        let mut c = RouteCensus::new(2, 8);
        // Call 1: two rows of k = 2 at layer 0 share expert 3; layer 1 all distinct.
        c.record(0, &[3, 1, 3, 5]);
        c.record(1, &[0, 1, 2, 3]);
        c.calls += 1;
        // Call 2: one row; ids out of range and a missing layer are ignored.
        c.record(0, &[3, 7, -1, 8]);
        c.record(1, &[6, 6]);
        c.record(2, &[1]);
        c.calls += 1;
        assert_eq!(c.distinct, vec![3 + 2, 4 + 1]);
        assert_eq!(c.mean_distinct(), vec![2.5, 2.5]);
        assert_eq!(c.load[0][3], 3);
        assert_eq!(c.load[1][6], 2);
        // Layer 0: 6 assignments over 8 experts, max 3 → 4.0; layer 1: 6, max 2 → 2.67.
        let want = (3.0 * 8.0 / 6.0 + 2.0 * 8.0 / 6.0) / 2.0;
        assert!((c.max_over_mean() - want).abs() < 1e-12);
        // The top 1/8 (one expert) takes 3/6 of layer 0 and 2/6 of layer 1.
        assert!((c.top_share(0.125) - (0.5 + 2.0 / 6.0) / 2.0).abs() < 1e-12);
        assert_eq!(c.top_share(1.0), 1.0);
        assert_eq!(RouteCensus::new(1, 4).max_over_mean(), 0.0);
        assert_eq!(RouteCensus::new(1, 4).mean_distinct(), vec![0.0]);
    }
}
