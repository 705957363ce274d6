//! How long to wait before retrying a failed row, and when to give up on it.

use std::time::Duration;

/// The smallest delay the policy ever returns (upstream Trellis clamps its retry delay to
/// at least 1 ms as well). A zero delay would make a failed row due again inside the same
/// drain wave.
pub const MIN_RETRY_DELAY: Duration = Duration::from_millis(1);

/// The largest initial or maximum delay a dispatcher accepts in a [`RetryPolicy`]: 365 days.
/// Longer delays are refused by [`DispatcherBuilder::start`](crate::DispatcherBuilder::start)
/// rather than stored: a retry time must fit the database's timestamp and interval types.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// Exponential backoff with jitter, a cap and a maximum number of attempts.
///
/// After the `n`-th failed attempt of a row (`n` starting at 1) the row is due again after
/// `initial_delay × multiplier^(n-1)`, capped at `max_delay`, spread by ±`jitter` (a
/// fraction) and never above `max_delay`. Once a row has failed `max_attempts` times it is
/// moved to `dead` instead of being retried.
///
/// Defaults: 1 s doubling up to 5 min, ±20 % jitter, 25 attempts (24 retries over about
/// 1 h 24 min: 511 s doubling, then 15 × 5 min).
///
/// The setters never panic. Out-of-range values are clamped, each by the rule on its setter:
/// delays are at least [`MIN_RETRY_DELAY`], the multiplier is at least 1, the jitter is
/// within `0.0..=1.0`, and at least one attempt is made.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use trellis_outbox::RetryPolicy;
///
/// let policy = RetryPolicy::new()
///     .initial_delay(Duration::from_millis(500))
///     .max_delay(Duration::from_secs(60))
///     .jitter(0.0)
///     .max_attempts(10);
///
/// assert_eq!(policy.delay(1), Duration::from_millis(500));
/// assert_eq!(policy.delay(2), Duration::from_secs(1));
/// assert_eq!(policy.delay(9), Duration::from_secs(60)); // 128 s, capped
/// assert!(!policy.gives_up_after(9));
/// assert!(policy.gives_up_after(10));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    initial_delay: Duration,
    max_delay: Duration,
    multiplier: f64,
    jitter: f64,
    max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            multiplier: 2.0,
            jitter: 0.2,
            max_attempts: 25,
        }
    }
}

impl RetryPolicy {
    /// The default policy: 1 s doubling up to 5 min, ±20 % jitter, 25 attempts.
    pub fn new() -> Self {
        Self::default()
    }

    /// A policy that retries after the same delay every time, with no jitter (upstream
    /// Trellis' `retryDelayMs`), still giving up after the default 25 attempts.
    ///
    /// ```
    /// use std::time::Duration;
    /// use trellis_outbox::RetryPolicy;
    ///
    /// let policy = RetryPolicy::fixed(Duration::from_secs(5));
    /// assert_eq!(policy.delay(1), Duration::from_secs(5));
    /// assert_eq!(policy.delay(20), Duration::from_secs(5));
    /// ```
    pub fn fixed(delay: Duration) -> Self {
        let delay = delay.max(MIN_RETRY_DELAY);
        Self {
            initial_delay: delay,
            max_delay: delay,
            multiplier: 1.0,
            jitter: 0.0,
            ..Self::default()
        }
    }

    /// The delay after the first failure. Clamped to at least [`MIN_RETRY_DELAY`].
    pub fn initial_delay(mut self, delay: Duration) -> Self {
        self.initial_delay = delay.max(MIN_RETRY_DELAY);
        self
    }

    /// The cap on any delay, jitter included. Clamped to at least [`MIN_RETRY_DELAY`]; a cap
    /// below the initial delay caps every delay, the first one included.
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay.max(MIN_RETRY_DELAY);
        self
    }

    /// The growth factor between consecutive delays (2.0 doubles). Values below 1.0, NaN
    /// included, become 1.0 (a fixed delay); infinity is allowed and reaches the cap at once.
    pub fn multiplier(mut self, multiplier: f64) -> Self {
        self.multiplier = if multiplier >= 1.0 { multiplier } else { 1.0 };
        self
    }

    /// The spread of each delay as a fraction: 0.2 picks uniformly within ±20 % of the base
    /// delay. Clamped to `0.0..=1.0`; NaN becomes 0.0 (no jitter).
    pub fn jitter(mut self, jitter: f64) -> Self {
        self.jitter = if jitter.is_nan() {
            0.0
        } else {
            jitter.clamp(0.0, 1.0)
        };
        self
    }

    /// How many failed attempts a row may have before it is moved to `dead`. Clamped to at
    /// least 1. `u32::MAX` effectively never gives up.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Checks that the policy's delays are at most [`MAX_RETRY_DELAY`]; the problem, naming
    /// the setter, if not. (Every other value is clamped by its setter.)
    pub(crate) fn validate(&self) -> Result<(), &'static str> {
        if self.initial_delay > MAX_RETRY_DELAY {
            return Err("initial_delay must be at most 365 days (MAX_RETRY_DELAY)");
        }
        if self.max_delay > MAX_RETRY_DELAY {
            return Err("max_delay must be at most 365 days (MAX_RETRY_DELAY)");
        }
        Ok(())
    }

    /// The configured maximum number of attempts.
    pub fn attempt_limit(&self) -> u32 {
        self.max_attempts
    }

    /// The delay after the `attempt`-th failed attempt, before jitter:
    /// `initial_delay × multiplier^(attempt-1)`, capped at `max_delay` and at least
    /// [`MIN_RETRY_DELAY`]. `attempt` 0 is treated as 1. Never decreases as `attempt` grows.
    ///
    /// ```
    /// use std::time::Duration;
    /// use trellis_outbox::RetryPolicy;
    ///
    /// let policy = RetryPolicy::new();
    /// assert_eq!(policy.base_delay(1), Duration::from_secs(1));
    /// assert_eq!(policy.base_delay(4), Duration::from_secs(8));
    /// assert_eq!(policy.base_delay(1000), Duration::from_secs(300));
    /// ```
    pub fn base_delay(&self, attempt: u32) -> Duration {
        let exponent = attempt.saturating_sub(1);
        let cap = self.max_delay.max(MIN_RETRY_DELAY);
        let initial = self.initial_delay.max(MIN_RETRY_DELAY);
        // Exponent clamped so `powi` cannot overflow to NaN paths; 2^1100 is already infinite.
        let factor = self.multiplier.max(1.0).powi(exponent.min(1100) as i32);
        let seconds = initial.as_secs_f64() * factor;
        let base = Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX);
        base.min(cap).max(MIN_RETRY_DELAY)
    }

    /// The delay after the `attempt`-th failed attempt, with jitter: a uniformly random
    /// duration within ±`jitter` of [`base_delay`](Self::base_delay), never above
    /// `max_delay` and never below [`MIN_RETRY_DELAY`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use trellis_outbox::RetryPolicy;
    ///
    /// let policy = RetryPolicy::new(); // 1 s, ±20 %
    /// let delay = policy.delay(1);
    /// assert!(delay >= Duration::from_millis(800) && delay <= Duration::from_millis(1200));
    /// ```
    pub fn delay(&self, attempt: u32) -> Duration {
        let unit = if self.jitter > 0.0 {
            rand::random_range(-1.0..=1.0)
        } else {
            0.0
        };
        self.jittered(attempt, unit)
    }

    /// The delay for `attempt` with the jitter sample `unit` in `-1.0..=1.0` (−1 is the
    /// shortest delay, +1 the longest).
    fn jittered(&self, attempt: u32, unit: f64) -> Duration {
        let base = self.base_delay(attempt);
        let unit = if unit.is_nan() {
            0.0
        } else {
            unit.clamp(-1.0, 1.0)
        };
        let factor = 1.0 + self.jitter.clamp(0.0, 1.0) * unit;
        let seconds = base.as_secs_f64() * factor;
        let delay = Duration::try_from_secs_f64(seconds).unwrap_or(base);
        delay
            .min(self.max_delay.max(MIN_RETRY_DELAY))
            .max(MIN_RETRY_DELAY)
    }

    /// The longest delay this policy can put between two attempts of a row, jitter
    /// included: the upper bound of [`delay`](Self::delay) for the last retried attempt.
    /// A JetStream stream's duplicate window should be at least this long, so a row
    /// re-published after a crash between publish and mark is still de-duplicated.
    ///
    /// ```
    /// use std::time::Duration;
    /// use trellis_outbox::RetryPolicy;
    ///
    /// assert_eq!(RetryPolicy::new().longest_delay(), Duration::from_secs(300));
    /// let short = RetryPolicy::new().max_attempts(3).jitter(0.5); // 1 s, 2 s (+50 %)
    /// assert_eq!(short.longest_delay(), Duration::from_secs(3));
    /// ```
    pub fn longest_delay(&self) -> Duration {
        // Rows are retried after attempts 1 ..= max_attempts - 1; base delays never decrease.
        let last_retried = self.max_attempts.saturating_sub(1).max(1);
        self.jittered(last_retried, 1.0)
    }

    /// Whether a row that has now failed `attempts` times (this failure included) should be
    /// moved to `dead` rather than retried: `attempts >= max_attempts`.
    ///
    /// ```
    /// use trellis_outbox::RetryPolicy;
    ///
    /// let policy = RetryPolicy::new().max_attempts(3);
    /// assert!(!policy.gives_up_after(2));
    /// assert!(policy.gives_up_after(3));
    /// ```
    pub fn gives_up_after(&self, attempts: u32) -> bool {
        attempts >= self.max_attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn defaults_match_the_issue() {
        let p = RetryPolicy::default();
        assert_eq!(p.base_delay(1), SEC);
        assert_eq!(p.base_delay(2), 2 * SEC);
        assert_eq!(p.base_delay(9), 256 * SEC);
        assert_eq!(p.base_delay(10), 300 * SEC);
        assert_eq!(p.base_delay(u32::MAX), 300 * SEC);
        assert_eq!(p.attempt_limit(), 25);
        assert!(!p.gives_up_after(24));
        assert!(p.gives_up_after(25));
        assert!(p.gives_up_after(26));
    }

    #[test]
    fn base_schedule_is_monotonic_and_capped() {
        for p in [
            RetryPolicy::new(),
            RetryPolicy::new()
                .multiplier(1.5)
                .max_delay(Duration::from_secs(7)),
            RetryPolicy::new().multiplier(f64::INFINITY),
            RetryPolicy::fixed(Duration::from_millis(3)),
        ] {
            let mut previous = Duration::ZERO;
            for attempt in 0..2000 {
                let d = p.base_delay(attempt);
                assert!(d >= previous, "{p:?}: attempt {attempt} went down");
                assert!(d <= p.max_delay && d >= MIN_RETRY_DELAY);
                previous = d;
            }
        }
        assert_eq!(
            RetryPolicy::new().multiplier(f64::INFINITY).base_delay(2),
            300 * SEC
        );
        assert_eq!(RetryPolicy::new().base_delay(0), SEC);
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let p = RetryPolicy::new();
        assert_eq!(p.jittered(1, -1.0), Duration::from_millis(800));
        assert_eq!(p.jittered(1, 1.0), Duration::from_millis(1200));
        assert_eq!(p.jittered(1, 0.0), SEC);
        assert_eq!(p.jittered(1, f64::NAN), SEC);
        // At the cap, jitter can only shorten the delay.
        assert_eq!(p.jittered(20, 1.0), 300 * SEC);
        assert_eq!(p.jittered(20, -1.0), 240 * SEC);
        let mut seen_low = false;
        let mut seen_high = false;
        for _ in 0..2000 {
            let d = p.delay(3); // base 4 s
            assert!(d >= Duration::from_millis(3200) && d <= Duration::from_millis(4800));
            seen_low |= d < Duration::from_millis(3900);
            seen_high |= d > Duration::from_millis(4100);
        }
        assert!(seen_low && seen_high, "jitter is not spreading delays");
        // Full jitter never reaches zero.
        assert_eq!(
            RetryPolicy::new().jitter(1.0).jittered(1, -1.0),
            MIN_RETRY_DELAY
        );
    }

    #[test]
    fn nonsense_values_are_clamped() {
        let p = RetryPolicy::new()
            .initial_delay(Duration::ZERO)
            .max_delay(Duration::ZERO)
            .multiplier(f64::NAN)
            .jitter(f64::NAN)
            .max_attempts(0);
        assert_eq!(p.initial_delay, MIN_RETRY_DELAY);
        assert_eq!(p.max_delay, MIN_RETRY_DELAY);
        assert_eq!(p.multiplier, 1.0);
        assert_eq!(p.jitter, 0.0);
        assert_eq!(p.attempt_limit(), 1);
        assert_eq!(p.delay(5), MIN_RETRY_DELAY);
        assert!(p.gives_up_after(1));
        assert_eq!(RetryPolicy::new().jitter(7.0).jitter, 1.0);
        assert_eq!(RetryPolicy::new().jitter(-1.0).jitter, 0.0);
        assert_eq!(RetryPolicy::new().multiplier(0.5).multiplier, 1.0);
        assert_eq!(RetryPolicy::fixed(Duration::ZERO).delay(3), MIN_RETRY_DELAY);
        // A cap below the initial delay caps the first delay too.
        let capped = RetryPolicy::new()
            .initial_delay(10 * SEC)
            .max_delay(SEC)
            .jitter(0.0);
        assert_eq!(capped.delay(1), SEC);
        // Huge values saturate instead of panicking.
        let huge = RetryPolicy::new()
            .initial_delay(Duration::MAX)
            .max_delay(Duration::MAX)
            .multiplier(f64::MAX);
        assert_eq!(huge.base_delay(u32::MAX), Duration::MAX);
        let _ = huge.delay(u32::MAX);
    }

    #[test]
    fn validate_bounds_the_delays() {
        assert_eq!(RetryPolicy::new().validate(), Ok(()));
        assert_eq!(RetryPolicy::fixed(MAX_RETRY_DELAY).validate(), Ok(()));
        assert_eq!(RetryPolicy::new().max_attempts(u32::MAX).validate(), Ok(()));
        let long = MAX_RETRY_DELAY + Duration::from_millis(1);
        assert_eq!(
            RetryPolicy::new().max_delay(long).validate(),
            Err("max_delay must be at most 365 days (MAX_RETRY_DELAY)")
        );
        assert_eq!(
            RetryPolicy::new().max_delay(Duration::MAX).validate(),
            Err("max_delay must be at most 365 days (MAX_RETRY_DELAY)")
        );
        assert_eq!(
            RetryPolicy::new()
                .initial_delay(Duration::MAX)
                .max_delay(SEC)
                .validate(),
            Err("initial_delay must be at most 365 days (MAX_RETRY_DELAY)")
        );
        assert!(RetryPolicy::fixed(Duration::MAX).validate().is_err());
    }

    #[test]
    fn extreme_policies_never_panic() {
        let policies = [
            RetryPolicy::fixed(MAX_RETRY_DELAY),
            RetryPolicy::new()
                .initial_delay(MAX_RETRY_DELAY)
                .max_delay(MAX_RETRY_DELAY)
                .multiplier(f64::MAX)
                .jitter(1.0)
                .max_attempts(u32::MAX),
            RetryPolicy::new()
                .initial_delay(Duration::MAX)
                .max_delay(Duration::MAX)
                .multiplier(f64::INFINITY)
                .max_attempts(u32::MAX),
        ];
        for p in policies {
            for attempt in [0, 1, 2, 63, 64, 1100, 1101, u32::MAX - 1, u32::MAX] {
                let d = p.delay(attempt);
                assert!(d >= MIN_RETRY_DELAY && d <= p.max_delay, "{p:?} {attempt}");
                let _ = p.jittered(attempt, 1.0);
                let _ = p.jittered(attempt, -1.0);
            }
            assert!(p.longest_delay() <= p.max_delay);
            assert!(!p.gives_up_after(u32::MAX - 1) || p.attempt_limit() < u32::MAX);
            if p.validate().is_ok() {
                // A validated policy's delays can be added to an Instant and a timestamp.
                let _ = std::time::Instant::now() + p.longest_delay();
                assert!(chrono::TimeDelta::from_std(p.longest_delay()).is_ok());
            }
        }
    }
}
