//! What one drain may do: [`DispatchOptions`] (batch size, lease, retry policy) and their
//! validation, and what it did: [`DispatchReport`].

use std::time::Duration;

use crate::dispatch::error::DispatchError;
use crate::dispatch::publisher::Publisher;
use crate::dispatch::retry::RetryPolicy;
#[cfg(doc)]
use crate::dispatch::{DispatcherBuilder, OutboxDispatcher, dispatch_outbox};

/// The setters of batch size, lease and retry policy, written once for [`DispatchOptions`]
/// (`option_setters!()`) and for [`DispatcherBuilder`] (`option_setters!(options)`, setting
/// its `options` field), so the two cannot drift apart in rules or documentation.
macro_rules! option_setters {
    ($($options:ident)?) => {
        crate::setters::setters! {
            /// How many rows each claim takes (default 100). Must be between 1 and 100,000.
            batch_size(rows: usize) => $($options.)? batch_size;

            /// How long claimed rows stay reserved for this dispatcher (default 30 s). Must
            /// be between 1 ms and 24 h, and longer than the publisher's
            /// [`publish_budget`](crate::Publisher::publish_budget) for a full batch.
            ///
            /// The dispatcher keeps the lease while it publishes: a batch that has less than
            /// its budget (or a third of the lease) left when its publish starts is extended
            /// first, and a running publish extends it whenever two thirds have passed. If
            /// the lease cannot be kept — another claim took a row, or the repository cannot
            /// extend it before it ends — the publish is stopped and the batch released, so
            /// two dispatchers never publish a row at the same time. A crashed dispatcher's
            /// rows wait for their lease to end.
            lease(lease: std::time::Duration) => $($options.)? lease;

            /// When failed rows are retried and when they are given up (default
            /// [`RetryPolicy::default`](crate::RetryPolicy::default)).
            retry_policy(policy: crate::RetryPolicy) => $($options.)? retry_policy;
        }
    };
}
pub(super) use option_setters;

/// The largest [`DispatchOptions::batch_size`].
const MAX_BATCH_SIZE: usize = 100_000;
/// The longest [`DispatchOptions::lease`].
const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);

const BATCH_TOO_LARGE: &str =
    "must be at most 100,000 rows (a claim holds its whole batch in memory)";
const LEASE_TOO_LONG: &str =
    "must be at most 24 hours (a crashed dispatcher's rows wait that long)";
const LEASE_WITHIN_BUDGET: &str = "must be longer than the publisher's publish budget for a \
     full batch (its timeouts added up); raise the lease or lower the batch size";

/// Options of one drain: batch size, lease and retry policy. Used by [`dispatch_outbox`]
/// and, through [`DispatcherBuilder`], by [`OutboxDispatcher`].
///
/// Defaults: batches of 100 rows, a 30 s lease, [`RetryPolicy::default`].
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use trellis_outbox::{DispatchOptions, RetryPolicy};
///
/// let options = DispatchOptions::new()
///     .batch_size(500)
///     .lease(Duration::from_secs(60))
///     .retry_policy(RetryPolicy::new().max_attempts(10));
/// # let _ = options;
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchOptions {
    pub(super) batch_size: usize,
    pub(super) lease: Duration,
    pub(super) retry_policy: RetryPolicy,
}

impl Default for DispatchOptions {
    fn default() -> Self {
        Self {
            batch_size: 100,
            lease: Duration::from_secs(30),
            retry_policy: RetryPolicy::default(),
        }
    }
}

impl DispatchOptions {
    /// The defaults: 100 rows per batch, a 30 s lease, the default retry policy.
    pub fn new() -> Self {
        Self::default()
    }

    option_setters!();

    /// Checks the options on their own and against `publisher`'s
    /// [`publish_budget`](Publisher::publish_budget).
    pub(super) fn validate(&self, publisher: &impl Publisher) -> Result<(), DispatchError> {
        let retry_policy = self.retry_policy.validate().err();
        // (option, whether it is in range, what is wrong otherwise), checked in order.
        let rules = [
            ("batch_size", self.batch_size >= 1, "must be at least 1"),
            (
                "batch_size",
                self.batch_size <= MAX_BATCH_SIZE,
                BATCH_TOO_LARGE,
            ),
            (
                "lease",
                self.lease >= Duration::from_millis(1),
                "must be at least 1 ms",
            ),
            ("lease", self.lease <= MAX_LEASE, LEASE_TOO_LONG),
            (
                "retry_policy",
                retry_policy.is_none(),
                retry_policy.unwrap_or_default(),
            ),
        ];
        if let Some(&(option, _, problem)) = rules.iter().find(|(_, ok, _)| !ok) {
            return Err(DispatchError::InvalidOption { option, problem });
        }
        // Asked last: the publisher's budget is only meaningful for a batch size in range.
        if publisher
            .publish_budget(self.batch_size)
            .is_some_and(|budget| budget >= self.lease)
        {
            return Err(DispatchError::InvalidOption {
                option: "lease",
                problem: LEASE_WITHIN_BUDGET,
            });
        }
        Ok(())
    }
}

/// What a drain did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DispatchReport {
    /// Rows marked `dispatched`.
    pub dispatched: u64,
    /// Rows marked `failed` (to be retried later).
    pub failed: u64,
    /// Rows moved to `dead` (permanent errors, retries exhausted, undecodable rows).
    pub dead: u64,
}

impl DispatchReport {
    pub(super) fn add(&mut self, other: DispatchReport) {
        self.dispatched += other.dispatched;
        self.failed += other.failed;
        self.dead += other.dead;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::publisher::TestPublisher;

    /// A publisher whose publish budget is one second per row.
    const SLOW_PUBLISHER: TestPublisher = TestPublisher(Some(Duration::from_secs(1)));

    #[test]
    fn options_are_validated() {
        let invalid = |options: DispatchOptions| match options.validate(&SLOW_PUBLISHER) {
            Err(DispatchError::InvalidOption { option, .. }) => option,
            other => panic!("{other:?} is not an invalid option"),
        };
        assert_eq!(invalid(DispatchOptions::new().batch_size(0)), "batch_size");
        assert_eq!(
            invalid(DispatchOptions::new().batch_size(usize::MAX)),
            "batch_size"
        );
        assert_eq!(
            invalid(DispatchOptions::new().lease(Duration::ZERO)),
            "lease"
        );
        assert_eq!(
            invalid(DispatchOptions::new().lease(Duration::MAX)),
            "lease"
        );
        assert_eq!(
            invalid(
                DispatchOptions::new()
                    .batch_size(20)
                    .retry_policy(RetryPolicy::new().max_delay(Duration::MAX))
            ),
            "retry_policy"
        );
        // 100 rows at one second each do not fit a 30 s lease …
        assert_eq!(invalid(DispatchOptions::new()), "lease");
        // … 20 rows do.
        assert!(
            DispatchOptions::new()
                .batch_size(20)
                .validate(&SLOW_PUBLISHER)
                .is_ok()
        );
        let error = DispatchOptions::new()
            .validate(&SLOW_PUBLISHER)
            .unwrap_err()
            .to_string();
        assert!(error.contains("publish budget"), "{error}");
    }
}
