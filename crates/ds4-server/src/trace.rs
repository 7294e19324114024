//! Test hook: the scheduler's step log ([`crate::ServerConfig::step_trace`]). Every forward
//! pass the scheduler runs is recorded in order, with the jobs it served, so a test can check
//! how prompts and decode steps interleave (docs/server.md §9) by counting, not by timing.
//! Not a user feature: without the hook nothing is recorded.

use std::sync::Mutex;

/// One forward pass of the scheduler. Jobs are named by their start number: 1 for the first
/// job the worker took off the queue, then 2, 3, … in the order it took them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepEvent {
    /// `tokens` prompt tokens of job `job` evaluated: one piece, or its share of a joint
    /// prefill (one event per job of the pass).
    Prefill { job: u64, tokens: usize },
    /// One batched decode step fed one token to each of `jobs`.
    Decode { jobs: Vec<u64> },
}

/// The recorded passes, oldest first.
#[derive(Debug, Default)]
pub struct StepTrace {
    events: Mutex<Vec<StepEvent>>,
}

impl StepTrace {
    /// What has been recorded so far.
    pub fn events(&self) -> Vec<StepEvent> {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(crate) fn push(&self, e: StepEvent) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(e);
    }
}

/// The largest number of prompt tokens of jobs other than `job` evaluated between two
/// consecutive decode steps that fed `job` (`None`: fewer than two such decode steps).
/// The scheduler's promise (docs/server.md §9) is that this never exceeds one step's prefill
/// budget, however long the prompts arriving while `job` generates.
pub fn largest_prefill_between_tokens(events: &[StepEvent], job: u64) -> Option<usize> {
    let mut largest: Option<usize> = None;
    let mut since: Option<usize> = None;
    for e in events {
        match e {
            StepEvent::Prefill { job: j, tokens } if *j != job => {
                if let Some(n) = since.as_mut() {
                    *n += tokens;
                }
            }
            StepEvent::Decode { jobs } if jobs.contains(&job) => {
                if let Some(n) = since {
                    largest = Some(largest.map_or(n, |l| l.max(n)));
                }
                since = Some(0);
            }
            _ => {}
        }
    }
    largest
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(job: u64, tokens: usize) -> StepEvent {
        StepEvent::Prefill { job, tokens }
    }

    fn d(jobs: &[u64]) -> StepEvent {
        StepEvent::Decode {
            jobs: jobs.to_vec(),
        }
    }

    #[test]
    fn the_gap_counts_other_jobs_prompt_tokens_between_two_of_a_jobs_tokens() {
        let ev = [
            p(1, 64),
            d(&[1]),
            p(2, 30),
            p(2, 34),
            d(&[1]),
            p(2, 64),
            d(&[1, 2]),
            d(&[2]),
            p(3, 100),
            d(&[1]),
        ];
        // Job 1: 64, then 64, then 100 (its own prompt before its first token is not a gap).
        assert_eq!(largest_prefill_between_tokens(&ev, 1), Some(100));
        // Job 2: one gap of 100 (its own pieces never count).
        assert_eq!(largest_prefill_between_tokens(&ev, 2), Some(0));
        assert_eq!(largest_prefill_between_tokens(&ev, 3), None);
        assert_eq!(largest_prefill_between_tokens(&[d(&[1])], 1), None);
    }
}
