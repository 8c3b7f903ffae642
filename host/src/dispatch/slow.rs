//! Slow attempts: an attempt of a kind with `slow_after_ms` that is still
//! waiting that long gives its host permit back, and stops counting under
//! its outbox's `outbox_max_in_flight`, while `dispatch.max_slow` has room.
//! It keeps its lanes, its lease, its destination's count and its place
//! under its kind's `max_in_flight`; only the permits it sat on move on.
//!
//! Why: a permit bounds what runs at once, but an attempt waiting on a
//! server that hangs until the timeout runs nothing. One request per hung
//! server (the per-destination cap keeps it at that) is still a permit per
//! server, so a fan-out reaching a few hundred dead servers, each on a host
//! of its own, held every permit for the timeout while the live inboxes
//! waited. `max_slow` still bounds the attempts (and their payloads) in
//! memory.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How one attempt may turn slow.
#[derive(Debug, Clone)]
pub(crate) struct SlowWatch {
    /// Its kind's `slow_after_ms`.
    pub after: Duration,
    /// The host's places for slow attempts (`dispatch.max_slow`).
    pub places: Arc<Semaphore>,
    /// Set once the attempt is slow; its drain counts it outside its caps.
    pub flag: Arc<AtomicBool>,
}

impl SlowWatch {
    /// Whether the attempt has turned slow.
    pub fn is_slow(flag: &AtomicBool) -> bool {
        flag.load(Ordering::Acquire)
    }
}

/// Runs `attempt` holding `permit` until it ends, or until it has waited
/// `watch.after` with a place free among the slow attempts: then the
/// permit goes back, the attempt is marked slow and `freed` says so (to
/// wake whoever waits for a permit), and the attempt goes on holding that
/// place instead. With no watch, or no place free then, the permit is held
/// to the end, as for any attempt.
pub(crate) async fn watch<F: Future>(
    attempt: F,
    permit: OwnedSemaphorePermit,
    watch: Option<SlowWatch>,
    freed: impl FnOnce(),
) -> F::Output {
    let mut attempt = std::pin::pin!(attempt);
    if let Some(watch) = watch {
        tokio::select! {
            biased;
            out = &mut attempt => return out,
            () = tokio::time::sleep(watch.after) => {}
        }
        if let Ok(place) = watch.places.try_acquire_owned() {
            // Marked before the permit goes: a drain counting its attempts
            // then never sees the permit free while the attempt still
            // counts as busy against its own share (the other way round,
            // it would start one op too few, not one too many).
            watch.flag.store(true, Ordering::Release);
            drop(permit);
            freed();
            let out = attempt.await;
            drop(place);
            return out;
        }
    }
    let out = attempt.await;
    drop(permit);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch_of(after: Duration, places: usize) -> SlowWatch {
        SlowWatch {
            after,
            places: Arc::new(Semaphore::new(places)),
            flag: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Polls `cond` until it holds (five seconds at most).
    async fn until(cond: impl Fn() -> bool) -> bool {
        for _ in 0..500 {
            if cond() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cond()
    }

    #[tokio::test]
    async fn a_quick_attempt_holds_its_permit_to_the_end_and_is_never_slow() {
        let permits = Arc::new(Semaphore::new(1));
        let w = watch_of(Duration::from_secs(60), 1);
        let permit = permits.clone().try_acquire_owned().unwrap();
        let out = watch(async { 7 }, permit, Some(w.clone()), || panic!("not slow")).await;
        assert_eq!(out, 7);
        assert_eq!(permits.available_permits(), 1);
        assert!(!SlowWatch::is_slow(&w.flag));
        assert_eq!(w.places.available_permits(), 1);
    }

    #[tokio::test]
    async fn a_waiting_attempt_gives_its_permit_back_and_holds_a_slow_place_until_it_ends() {
        let permits = Arc::new(Semaphore::new(1));
        let w = watch_of(Duration::from_millis(10), 1);
        let permit = permits.clone().try_acquire_owned().unwrap();
        let (answer, answered) = tokio::sync::oneshot::channel::<u32>();
        let freed = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let (w, freed) = (w.clone(), freed.clone());
            async move {
                watch(async { answered.await.unwrap_or(0) }, permit, Some(w), move || {
                    freed.store(true, Ordering::SeqCst)
                })
                .await
            }
        });
        assert!(until(|| permits.available_permits() == 1).await, "the permit came back");
        assert!(SlowWatch::is_slow(&w.flag));
        assert!(freed.load(Ordering::SeqCst), "whoever waits for a permit was told");
        assert_eq!(w.places.available_permits(), 0, "it holds a slow place");
        answer.send(5).unwrap();
        assert_eq!(task.await.unwrap(), 5);
        assert_eq!(w.places.available_permits(), 1, "the place is given back at the end");
    }

    #[tokio::test]
    async fn with_no_slow_place_free_the_attempt_keeps_its_permit() {
        let permits = Arc::new(Semaphore::new(1));
        let w = watch_of(Duration::from_millis(10), 0);
        let permit = permits.clone().try_acquire_owned().unwrap();
        let (answer, answered) = tokio::sync::oneshot::channel::<u32>();
        let task = tokio::spawn({
            let w = w.clone();
            async move {
                watch(async { answered.await.unwrap_or(0) }, permit, Some(w), || {
                    panic!("no place")
                })
                .await
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(permits.available_permits(), 0, "the permit stays with the attempt");
        assert!(!SlowWatch::is_slow(&w.flag));
        answer.send(1).unwrap();
        assert_eq!(task.await.unwrap(), 1);
        assert_eq!(permits.available_permits(), 1);
    }

    #[tokio::test]
    async fn without_a_watch_the_permit_is_held_to_the_end() {
        let permits = Arc::new(Semaphore::new(1));
        let permit = permits.clone().try_acquire_owned().unwrap();
        let (answer, answered) = tokio::sync::oneshot::channel::<u32>();
        let task = tokio::spawn(async move { watch(async { answered.await.unwrap_or(0) }, permit, None, || {}).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(permits.available_permits(), 0);
        answer.send(2).unwrap();
        assert_eq!(task.await.unwrap(), 2);
        assert_eq!(permits.available_permits(), 1);
    }
}
