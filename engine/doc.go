// Package engine owns all lock state of a leash client: per-lock waiter queues, the
// acquire attempt in flight, held locks and their watchdog renewals. Every mutation
// of that state happens under one mutex, held by the engine goroutine (the loop)
// for each round of messages, and by nobody across I/O. Three exceptions to "the
// loop steps the machine": a Lock or Unlock made while the loop is idle steps the
// machine on its own goroutine, runs its one script call there and steps the
// reply too (Engine.tryDirect), so that an uncontended lock costs its round trips
// and no goroutine hand-off; a batch's sender steps the machine with the batch's
// replies itself (Engine.sender); and an unlock or grant message that finds the
// engine idle is stepped by the pub/sub reader that delivers it
// (Engine.stepNotice), so a grant reaches its caller with no hop through the loop.
//
// The package is split the way etcd's raft splits node.go from rawnode.go:
//
//   - machine (machine.go, waiters.go, holds.go) is a pure state machine: one method
//     per message, each taking the current monotonic time, blocking on nothing,
//     starting no goroutine, and appending effects (scripts to run, futures to
//     complete, timers to arm, channels to subscribe) to an effects list;
//   - Engine (engine.go) is the thin loop: it receives messages, calls the machine,
//     and carries out the effects. Redis I/O never runs on the loop goroutine: the
//     pending script calls go out as one batch on a sender goroutine, merged into
//     few script calls (scripts.RunBatch), at most four batches in flight (see
//     maxSends; under load, a call that only its caller waits for may wait for a
//     fuller batch before taking a slot: waitForFill); a call alone in flight
//     takes the runner's dedicated connection (scripts.RunLone), where lockapi's
//     connections poll briefly for its reply (internal/replyspin). The sender steps the
//     machine with the replies and sends what is pending by then, and ends when
//     nothing is. Timer firings, unlock messages that find the engine busy, and
//     cancellations come back through a mailbox that never blocks its sender, so
//     the loop never waits on anyone and nobody waits on the loop for long.
//
// Fairness and cost, the short version (the long one sits next to the code):
// waiters of one lock queue FIFO in their process; one unlock message lets exactly
// one local waiter, the head, retry (one script call per message per process, not
// one per waiter); when the releasing owner and the next local waiter live in the
// same process, one script hands the lock over without a pub/sub hop, bounded so
// other processes' waiters are not starved, and below that bound the next waiter
// is granted as the Unlock arrives, under the releaser's lease, before the script's
// reply confirms the swap (handoff.go); holders that unlock before that reply pass
// the lock on with no call at all, and one follow-up call moves it to the last of
// them (relay.go; the fair lock down the run of its waiters that the last reply
// says head the Redis queue, fairrun.go). A waiter in another process is granted by
// the release itself when its client registered it, and hears of it on its
// client's grant channel, with no call of its own (directgrant.go; the fair lock's
// own in fair.go). Grants are completed after the step's I/O
// goroutines start (machine.deliver), and an unused lock's state is kept a while
// for reuse (locks.go).
package engine
