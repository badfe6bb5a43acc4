package engine

import (
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// effects is what one machine step asks the loop to carry out. Futures are completed
// by the machine itself: completion never blocks (see package futures).
type effects struct {
	scripts []scriptCall
	timers  []timerOp
	subs    []subOp
}

func (fx *effects) reset() {
	clear(fx.scripts)
	fx.scripts = fx.scripts[:0]
	fx.timers = fx.timers[:0]
	clear(fx.subs)
	fx.subs = fx.subs[:0]
}

// purpose says what a script call was for, and so what its reply means.
type purpose uint8

const (
	purposeAttempt purpose = iota + 1 // acquire for a waiter
	purposeHandoff                    // release by a local owner and grant to the local head, in one call
	purposeUnlock                     // release one hold
	purposeAbandon                    // give back a grant nobody received, or a lost hold (owner-guarded)
	purposeForce                      // force-release
	purposeRenew                      // watchdog renewal of a batch of holds
	purposeLeave                      // a fair waiter leaves the Redis queue
)

// scriptCall is one script to run, with what the machine needs to read its reply.
type scriptCall struct {
	script   scripts.ID
	keys     []string
	args     []string
	purpose  purpose
	lock     uint64   // lock id
	waiter   uint64   // purposeAttempt, purposeHandoff
	receiver uint64   // purposeHandoff: the waiter's owner
	hold     uint64   // purposeUnlock, purposeHandoff (early: the receiver's new hold, 0 if none)
	early    bool     // purposeHandoff: the receiver was granted before the reply (see handoff.go)
	run      []uint64 // purposeHandoff, fair: the waiters whose fields are fair_handoff's run (see fairrun.go)
	owner    uint64   // purposeLeave; and with serial, the owner whose call this is
	serial   bool     // one of the owner's serialized calls (see serial.go)
	joining  bool     // purposeAttempt: a fair waiter's first attempt (see fairAdvance)
	// fresh: purposeAttempt, a plain lock's first attempt on a lock that looks
	// free (no local hold, its last attempt not refused): the lone lane may take
	// it with one plain command (scripts.FreshRunner), and so may a batch
	// (scripts.Call.Fresh; see resendRefusedFresh); or a fair lock's first
	// attempt where the lock's last release here found nobody queued (see
	// fairAttempt): two, on the lone lane (scripts.FreshFairRunner).
	fresh bool
	// quiet: purposeUnlock, a lock's release of its only holder's last count,
	// with no waiter here and nobody listening (or, fair, queued) at the lock's
	// last release (quietRelease): the lone lane may take it with two plain
	// commands (scripts.QuietReleaser), and a batch a plain lock's
	// (scripts.Call.Quiet).
	quiet    bool
	channel  string   // fresh, fair: the lock's unlock channel (scripts.FreshFairRunner)
	batch    []uint64 // purposeRenew: hold ids, in KEYS order
	check    bool     // purposeRenew: a check of one hold a force-release may have deleted (see checkForced)
	retried  bool     // this is the one retry after a transport error (releases, leaves, early handoffs)
	giveBack uint64   // purposeAbandon, purposeLeave: the give-back's sequence number, 0 if none (see giveback.go)
	// releaserLost: an early handoff's releasing hold's Lost signal, if asked for.
	releaserLost *futures.Signal
	// firstSent: on a retry, when the first try was sent.
	firstSent time.Time
	// firstUnrun: on a retry, the first try is known not to have run
	// (scripts.ErrReordered): the retry's reply is read as a first try's.
	firstUnrun bool
	// backoff: on a leave sent again after transport errors, how long it
	// waited before this send (see retryLeaveLater).
	backoff time.Duration
	unlock  *futures.Future[error]
	force   *futures.Future[forceResult]
	// relayed: on a relay's follow-up handoff, or on the owner-guarded release that
	// replaces it, the relay whose Unlocks this call's reply answers (see relay.go).
	relayed *relay
}

// Timer kinds (timer.Key.Kind).
const (
	kindRetry      uint8 = iota + 1 // a lock's head waiter retries (TTL deadline, backoff)
	kindWait                        // a waiter's wait ran out
	kindExpiry                      // a hold's lease may run out: close its Lost
	kindSweep                       // the watchdog's renewal sweep
	kindLinger                      // an idle lock's subscription may be dropped
	kindFairRetry                   // a fair-lock waiter retries (the one ahead may have timed out)
	kindForget                      // idle lock states are dropped (see locks.go)
	kindLeaveRetry                  // a leave that failed is sent again (see retryLeaveLater)
)

// timerOp arms (d >= 0) or cancels (cancel) one timer entry.
type timerOp struct {
	key    timer.Key
	d      time.Duration
	cancel bool
}

// subOp subscribes or unsubscribes a lock's channel.
type subOp struct {
	lock        uint64
	channel     string
	pattern     bool // channel is a glob pattern (PSUBSCRIBE)
	unsubscribe bool
}
