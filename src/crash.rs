//! A dispatcher in a child process that a test kills with SIGKILL: the child's body, how the
//! parent starts it (the test binary itself, running one ignored test), and a publisher that
//! records publishes in a table, so what the child published survives its death.

use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use trellis_outbox::{
    OutboxDispatcher, OutboxMessage, PgOutboxRepository, PublishError, Publisher,
};

use crate::database_url;

/// Records publishes in the `published (id text)` table, in order, as a broker would: what
/// was published stays visible after the kill. `pause` is slept before and after the
/// write: a slow broker, so a kill often lands between claim, publish and mark.
#[derive(Debug, Clone)]
pub struct TablePublisher {
    /// The database holding `published`.
    pub pool: sqlx::PgPool,
    /// Slept before and after the write.
    pub pause: Duration,
}

impl Publisher for TablePublisher {
    async fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
        tokio::time::sleep(self.pause).await;
        let ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();
        let stored = sqlx::query(
            "INSERT INTO published (id) SELECT id FROM UNNEST($1::text[]) WITH ORDINALITY AS t(id, i) ORDER BY i",
        )
        .bind(&ids)
        .execute(&self.pool)
        .await;
        tokio::time::sleep(self.pause).await;
        messages
            .iter()
            .map(|_| match &stored {
                Ok(_) => Ok(None),
                Err(e) => Err(PublishError::retryable(e.to_string())),
            })
            .collect()
    }
}

/// The child's body: when `env` names a database, dispatches its outbox with a
/// [`TablePublisher`] (batches of `batch_size`, 2 s leases) until killed; otherwise (the
/// ignored test run on its own) returns at once.
pub async fn run_child_dispatcher(env: &str, batch_size: usize, pause: Duration) {
    let Ok(db_name) = std::env::var(env) else {
        return;
    };
    let options = PgConnectOptions::from_str(&database_url())
        .expect("DATABASE_URL is a Postgres URL")
        .database(&db_name);
    let pool = sqlx::PgPool::connect_with(options)
        .await
        .expect("the child connects to the parent's database");
    let dispatcher = OutboxDispatcher::builder(
        PgOutboxRepository::new(pool.clone()),
        TablePublisher { pool, pause },
    )
    .batch_size(batch_size)
    .lease(Duration::from_secs(2))
    .start()
    .expect("the child's dispatcher starts");
    // Run until killed.
    tokio::time::sleep(Duration::from_secs(120)).await;
    dispatcher.shutdown().await;
}

/// A child process that is killed (SIGKILL, by its pid) and reaped if it still runs when
/// the guard is dropped: a test that fails while its child runs does not leave it behind.
/// `std::process::Child` itself neither kills nor waits on drop.
#[derive(Debug)]
pub struct ChildGuard(Option<Child>);

impl ChildGuard {
    /// Guards `child`.
    pub fn new(child: Child) -> Self {
        Self(Some(child))
    }

    /// The child, no longer guarded (for `Child::wait_with_output`, which takes it).
    pub fn into_inner(mut self) -> Child {
        self.0
            .take()
            .expect("a guard holds its child until dropped")
    }
}

impl std::ops::Deref for ChildGuard {
    type Target = Child;

    fn deref(&self) -> &Child {
        self.0
            .as_ref()
            .expect("a guard holds its child until dropped")
    }
}

impl std::ops::DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        self.0
            .as_mut()
            .expect("a guard holds its child until dropped")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut()
            && matches!(child.try_wait(), Ok(None))
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts this test binary again, running only the ignored test `child_test` with `env`
/// naming `db_name`. The caller kills it by its pid (`Child::kill`) and waits for it; if the
/// test fails first, the guard kills it.
pub fn spawn_child(child_test: &str, env: &str, db_name: &str) -> ChildGuard {
    let exe = std::env::current_exe().expect("the test binary's path");
    ChildGuard::new(
        Command::new(exe)
            .args([
                "--exact",
                child_test,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(env, db_name)
            .stdout(Stdio::null())
            .spawn()
            .expect("the test binary starts again as the child"),
    )
}
