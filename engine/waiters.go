package engine

import (
	"context"
	"time"

	"github.com/leash-go/leash/futures"
)

// waiter is one pending Acquire. It lives in machine.waiters from its request until
// its future is completed, and in its lock's queue while it waits its turn.
//
// Its size matters: thousands may wait on one lock. A waiter is about 200 bytes,
// plus its future's channel and the context.AfterFunc registration.
type waiter struct {
	id    uint64
	lock  *lockState
	owner uint64
	field string // the owner's field, once made (see machine.waiterField)
	// sentField is the field its last lock_acquire named: its owner's, or, for a
	// re-entry, its hold's (a direct grant's, maybe).
	sentField string
	// freshFailed: its last attempt was a fair lock's fresh one (RESTORE and
	// LINDEX) and failed with a transport error (see attemptFailed).
	freshFailed bool
	// grantedField, when set, is the field its grant is under, if not its owner's:
	// a re-entry's under its hold's field, a direct grant's (see machine.grant).
	grantedField string
	lease        time.Duration // 0: watchdog
	ctx          context.Context
	stop         func() bool // unregisters the cancellation callback; nil when ctx never ends
	future       *futures.Future[error]

	deadline time.Time // zero: no wait limit besides ctx

	prev, next *waiter // queue links; both nil and not head when not queued
	queued     bool

	direct     bool  // attempting outside the queue (holder re-entering, single try)
	oneShot    bool  // wait 0: one attempt only
	attempting bool  // an acquire or handoff for this waiter is in flight
	expired    bool  // the wait ran out while an attempt was in flight
	cancelErr  error // the context ended (or the client closed) while an attempt was in flight
	lastErr    error // the last transport error, reported if the wait runs out
	// ambiguous: the last attempt failed with a transport error, so its script may
	// have run; a waiter that ends so is cleaned up after (finish, undoAmbiguous).
	ambiguous bool

	// Plain locks only (see directgrant.go).
	refused    bool  // an attempt of its was refused: the next ones register
	registered bool  // an attempt of its registered it for direct grants
	grantHeard bool  // a direct grant's message came while its attempt was in flight
	grantStamp int64 // that message's stamp
	leaving    int   // lock_leave calls for it in flight (see runLeave)

	// Fair locks only.
	enqueued    bool      // in the Redis queue
	queuedAt    time.Time // send time of its last attempt that found it queued
	joinPending bool      // its next attempt is a join counted in lockState.joining
	wake        bool      // its turn may have come: retry when nothing else is in flight
	claimOnly   bool      // a grant message for it is claimed with a call, not taken (see fairGrantsInDoubt)
	regs        uint32    // direct-grant registrations sent; the last one's number is current (see fairGranted)
	retryGen    uint64    // generation of its retry timer; 0 = none armed
}

// queue is an intrusive FIFO of waiters: O(1) push, pop and removal from the middle
// (a cancelled waiter leaves at once, wherever it stands).
//
// Why FIFO: a waiter that arrived first has waited longest; serving it first bounds
// every waiter's wait by the work ahead of it, which no retry race can do (the
// peers' polling lets the releaser barge, so some goroutines starve).
type queue struct {
	head, tail *waiter
	len        int
}

func (q *queue) push(w *waiter) {
	w.queued = true
	w.prev, w.next = q.tail, nil
	if q.tail != nil {
		q.tail.next = w
	} else {
		q.head = w
	}
	q.tail = w
	q.len++
}

func (q *queue) pushFront(w *waiter) {
	w.queued = true
	w.prev, w.next = nil, q.head
	if q.head != nil {
		q.head.prev = w
	} else {
		q.tail = w
	}
	q.head = w
	q.len++
}

// insertAfter puts w, not queued, right after at (at the front when at is nil).
func (q *queue) insertAfter(at, w *waiter) {
	if at == nil {
		q.pushFront(w)
		return
	}
	if at == q.tail {
		q.push(w)
		return
	}
	w.queued = true
	w.prev, w.next = at, at.next
	at.next.prev = w
	at.next = w
	q.len++
}

func (q *queue) remove(w *waiter) {
	if !w.queued {
		return
	}
	if w.prev != nil {
		w.prev.next = w.next
	} else {
		q.head = w.next
	}
	if w.next != nil {
		w.next.prev = w.prev
	} else {
		q.tail = w.prev
	}
	w.prev, w.next, w.queued = nil, nil, false
	q.len--
}

// receipt is a grant delivered to a caller whose context is still watched, so the
// grant can be taken back if the caller walks away without receiving it.
type receipt struct {
	id     uint64 // the waiter's id
	future *futures.Future[error]
	stop   func() bool
	hold   uint64
	ctx    context.Context // the caller's: ended, it walks away (see takeBackWalkedAway)
}
