//! Where a prompt's prefill pieces end (docs/server.md §9 "Prefill boundaries").
//!
//! A piece's rows get the bits of the piece they are evaluated in: a piece of at most 32
//! tokens runs as decode rows (docs/forward.md §13), and on a GPU the prefill kernels' sums
//! depend on the piece's width. So a state is the same whether computed cold or restored
//! only if the tokens before it were cut into the same pieces. Every piece therefore ends
//! at a fixed absolute position — a multiple of the step's grid, of the checkpoint
//! alignment or of the `continued` step, or the prompt's cold-checkpoint position (the end
//! of its shared system prefix when that is long enough) — whether the run started cold or
//! from a reused state, and whether a disk cache is configured or not: a checkpoint (or turn
//! snapshot) at one of a
//! prompt's cut positions is the state the prompt's cold run passes through, bit for bit,
//! and what follows it is evaluated in the same pieces.

use crate::config::DiskCacheConfig;

/// The grids every prompt is cut on. Positions are absolute (from the first token of the
/// state, not of the piece being evaluated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cuts {
    /// Every multiple of this: the step's budget, at most one engine chunk (so the engine
    /// never splits a piece on a grid of its own).
    pub grid: usize,
    /// Every multiple of the cold checkpoints' alignment (0: none).
    pub align: usize,
    /// Every multiple of the `continued` step (0: none).
    pub continued: usize,
}

impl Cuts {
    /// The cuts of a server whose steps evaluate at most `piece` prompt tokens with an
    /// engine chunk of `chunk`, and whose checkpoints follow `d` (the disk cache's settings,
    /// or their defaults when there is no disk cache: the cuts do not depend on whether a
    /// checkpoint is written).
    pub fn new(piece: usize, chunk: usize, d: &DiskCacheConfig) -> Cuts {
        Cuts {
            grid: piece.min(chunk).max(1),
            align: d.boundary_align_tokens,
            continued: d.continued_step(),
        }
    }

    /// The end of the piece that starts at absolute position `pos` of a prompt ending at
    /// `end` (> `pos`): the first grid line, checkpoint alignment, `continued` position or
    /// `mark` after `pos`, or `end`.
    pub fn next(&self, pos: usize, end: usize, mark: Option<usize>) -> usize {
        let mut e = end;
        for m in [self.grid, self.align, self.continued] {
            if let Some(q) = pos.checked_div(m) {
                e = e.min((q + 1).saturating_mul(m));
            }
        }
        if let Some(b) = mark.filter(|&b| b > pos) {
            e = e.min(b);
        }
        e
    }
}

/// The end of the shared system/tools prefix of `tokens`: the position of the last `user`
/// marker before the first `assistant` marker (> 0), where a cold checkpoint lands.
fn system_end(tokens: &[u32], user: u32, assistant: u32) -> Option<usize> {
    let first_a = tokens
        .iter()
        .position(|&t| t == assistant)
        .unwrap_or(tokens.len());
    tokens[..first_a]
        .iter()
        .rposition(|&t| t == user)
        .filter(|&u| u > 0)
}

/// Where the cold rule (docs/server.md §11 `cold`) checkpoints a prompt of `tokens`, for
/// any length (whether it is saved also depends on `cold_max_tokens`): the end of the
/// system prefix when at least `min_tokens`, else the length less the trim, aligned down,
/// when that is at least `min_tokens`, else the whole prompt. `None` below `min_tokens`.
pub(crate) fn cold_position(
    tokens: &[u32],
    user: u32,
    assistant: u32,
    d: &DiskCacheConfig,
) -> Option<usize> {
    let len = tokens.len();
    let min = d.min_tokens.max(1);
    if len < min {
        return None;
    }
    if let Some(u) = system_end(tokens, user, assistant).filter(|&u| u >= min) {
        return Some(u);
    }
    let mut b = len.saturating_sub(d.boundary_trim_tokens);
    if let Some(q) = b.checked_div(d.boundary_align_tokens) {
        b = q * d.boundary_align_tokens;
    }
    Some(if b >= min { b } else { len })
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: u32 = 1;
    const A: u32 = 2;

    fn cfg(min: usize, trim: usize, align: usize, continued: usize) -> DiskCacheConfig {
        DiskCacheConfig {
            min_tokens: min,
            boundary_trim_tokens: trim,
            boundary_align_tokens: align,
            continued_interval_tokens: continued,
            ..DiskCacheConfig::new("/nonexistent")
        }
    }

    /// Every piece of a run from `start` to `end`.
    fn pieces(c: &Cuts, start: usize, end: usize, mark: Option<usize>) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut pos = start;
        while pos < end {
            let e = c.next(pos, end, mark);
            out.push((pos, e));
            pos = e;
        }
        out
    }

    #[test]
    fn pieces_end_on_absolute_positions_whatever_the_start() {
        let c = Cuts::new(64, 64, &cfg(16, 8, 128, 0));
        assert_eq!(
            c,
            Cuts {
                grid: 64,
                align: 128,
                continued: 0
            }
        );
        let mark = Some(90);
        let cold = pieces(&c, 0, 200, mark);
        assert_eq!(
            cold,
            vec![(0, 64), (64, 90), (90, 128), (128, 192), (192, 200)]
        );
        // Resumed at any cut position, the rest is cut as the cold run cut it.
        for (start, _) in &cold {
            let resumed = pieces(&c, *start, 200, mark);
            assert!(cold.ends_with(&resumed), "from {start}: {resumed:?}");
        }
        // Resumed between cuts, the next piece ends at the cold run's next cut.
        assert_eq!(pieces(&c, 100, 200, mark)[0], (100, 128));
        // The step's budget narrows the grid; the engine chunk bounds it.
        assert_eq!(Cuts::new(32, 64, &cfg(16, 8, 0, 0)).grid, 32);
        assert_eq!(Cuts::new(4096, 2048, &cfg(16, 8, 0, 0)).grid, 2048);
    }

    #[test]
    fn alignment_and_continued_steps_are_cuts() {
        // An alignment that is not a multiple of the grid adds its own lines.
        let c = Cuts::new(64, 64, &cfg(16, 8, 48, 0));
        assert_eq!(
            pieces(&c, 0, 150, None),
            vec![
                (0, 48),
                (48, 64),
                (64, 96),
                (96, 128),
                (128, 144),
                (144, 150)
            ]
        );
        // The continued step (rounded up to the alignment) is one too.
        let c = Cuts::new(4096, 4096, &cfg(16, 8, 0, 5000));
        assert_eq!(c.continued, 5000);
        assert_eq!(
            pieces(&c, 0, 9000, None),
            vec![(0, 4096), (4096, 5000), (5000, 8192), (8192, 9000)]
        );
    }

    #[test]
    fn the_cold_position_follows_the_cold_rule() {
        let d = cfg(4, 2, 8, 0);
        // System prefix: the last ⟨U⟩ before the first ⟨A⟩.
        let t = [9, 9, 9, 9, 9, U, 9, U, 9, A, 9, U, 9, A];
        assert_eq!(system_end(&t, U, A), Some(7));
        assert_eq!(cold_position(&t, U, A, &d), Some(7));
        // Too short a system prefix: the trimmed length aligned down (14 − 2 → 8).
        let t = [9, U, 9, A, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9];
        assert_eq!(cold_position(&t, U, A, &d), Some(8));
        // Aligned below the minimum: the whole prompt; shorter than the minimum: none.
        assert_eq!(cold_position(&[9; 9], U, A, &cfg(9, 2, 8, 0)), Some(9));
        assert_eq!(cold_position(&[9; 3], U, A, &d), None);
        // A ⟨U⟩ at position 0 is no prefix.
        assert_eq!(system_end(&[U, 9, A], U, A), None);
    }
}
