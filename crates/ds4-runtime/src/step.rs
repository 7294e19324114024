//! One generation step's distribution as the backend left it (docs/server.md §6): the
//! logits row on the host, or the band of logits near the maximum while the row stays on
//! the device. [`crate::GenState::pick`]
//! fetches the row only when the step needs it — a steer that reads it, a band too short
//! for the draw — so a default min-p draw moves a few hundred bytes per token, not the
//! 129,280-float row.

use ds4_engine::sampler::LogitBand;
use ds4_engine::Session;

use crate::driver::DriverError;

/// What one step's distribution is, and how to get its row.
pub trait StepLogits {
    /// The band of the row near its maximum, while the row is not on the host.
    fn band(&self) -> Option<&LogitBand> {
        None
    }

    /// The logits row, fetched from the backend when it is not on the host yet (after
    /// that, [`StepLogits::band`] may answer `None`).
    fn row(&mut self) -> Result<&mut [f32], DriverError>;
}

/// A row already on the host.
impl StepLogits for Vec<f32> {
    fn row(&mut self) -> Result<&mut [f32], DriverError> {
        Ok(self)
    }
}

/// A row on the host, borrowed (a verify step's rows, picked one by one in place).
impl StepLogits for &mut [f32] {
    fn row(&mut self) -> Result<&mut [f32], DriverError> {
        Ok(self)
    }
}

/// What a one-state decode step left beside the host buffer.
#[derive(Debug, Clone)]
pub(crate) enum Left {
    /// The row is in the host buffer.
    Row,
    /// The band; the row is in the backend's scratch.
    Band(LogitBand),
}

/// A session's last step: `row` holds the logits when `left` is [`Left::Row`], else the
/// session's scratch does until its next evaluation.
pub(crate) struct SessionStep<'a> {
    pub left: &'a mut Left,
    pub row: &'a mut Vec<f32>,
    pub session: &'a mut Session,
}

impl StepLogits for SessionStep<'_> {
    fn band(&self) -> Option<&LogitBand> {
        match &*self.left {
            Left::Band(b) => Some(b),
            _ => None,
        }
    }

    fn row(&mut self) -> Result<&mut [f32], DriverError> {
        if !matches!(self.left, Left::Row) {
            self.session.last_logits_into(self.row)?;
            *self.left = Left::Row;
        }
        Ok(self.row)
    }
}

/// Whether a band stands for the row `GenState::pick` would sample when EOS is masked
/// (`mask`): a band computed without the mask still does unless EOS is in it, or is the
/// row's first NaN or +inf (the masked row would not report it).
pub(crate) fn band_fits_mask(band: &LogitBand, mask: Option<u32>) -> bool {
    let Some(eos) = mask else { return true };
    band.first_nan != Some(eos)
        && band.first_pos_inf != Some(eos)
        && band.items.iter().all(|&(i, _)| i != eos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_band_holding_eos_does_not_stand_for_the_masked_row() {
        let band = LogitBand {
            max: 2.0,
            threshold: -1.0,
            count: 2,
            first_nan: None,
            first_pos_inf: None,
            items: vec![(3, 2.0), (9, 0.5)],
        };
        assert!(band_fits_mask(&band, None));
        assert!(band_fits_mask(&band, Some(4)));
        assert!(!band_fits_mask(&band, Some(9)));
        let nan = LogitBand {
            first_nan: Some(4),
            ..band.clone()
        };
        assert!(!band_fits_mask(&nan, Some(4)));
        let inf = LogitBand {
            first_pos_inf: Some(4),
            ..band
        };
        assert!(!band_fits_mask(&inf, Some(4)));
        assert!(band_fits_mask(&inf, Some(5)));
    }
}
