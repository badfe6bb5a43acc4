package engine

import (
	"context"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// message is everything the loop receives. The set is sealed: only this package's
// types implement it, and machine.handle switches over all of them but wakeMsg
// and batchDone, which Engine.step takes itself.
type message interface{ isMessage() }

// Requests from callers, sent on the inbox.
type (
	// acquireMsg asks for a lock on behalf of one owner.
	acquireMsg struct {
		id     uint64 // the waiter's id, also the key of its cancellation
		lock   string
		owner  uint64
		fair   bool          // a fair (FIFO across processes) lock
		lease  time.Duration // 0: watchdog
		wait   time.Duration // < 0: until ctx ends; 0: one attempt; > 0: at most this long
		ctx    context.Context
		stop   func() bool // unregisters the context.AfterFunc that posts cancelMsg; nil if ctx never ends
		future *futures.Future[error]
		// giveBacksBefore: the owner's give-backs numbered below it are waited for;
		// 0 until the request is first handled (see giveback.go).
		giveBacksBefore uint64
	}
	// unlockMsg releases one hold.
	unlockMsg struct {
		lock            string
		owner           uint64
		future          *futures.Future[error]
		giveBacksBefore uint64 // see acquireMsg
		// hold: the id of the owner's hold when the Unlock first arrived, the only
		// hold it may release; 0 until then (see onUnlock).
		hold uint64
	}
	// forceUnlockMsg deletes a lock whoever holds it.
	forceUnlockMsg struct {
		lock   string
		fair   bool
		future *futures.Future[forceResult]
	}
	// lostMsg asks for the Lost signal of an owner's current hold.
	lostMsg struct {
		lock   string
		owner  uint64
		future *futures.Future[<-chan struct{}]
	}
	// closeMsg starts the engine's shutdown.
	closeMsg struct{}
	// settleMsg: complete future once owner has no serialized call on lock in
	// flight, nor a give-back that was in flight when it came (see onSettle).
	settleMsg struct {
		lock            string
		owner           uint64
		future          *futures.Future[error]
		giveBacksBefore uint64 // see acquireMsg
	}
	// statsMsg asks for a snapshot of the engine's counters.
	statsMsg struct{ future *futures.Future[Stats] }
	// fieldMsg asks for the field of owner's hold on lock ("" when none).
	fieldMsg struct {
		lock   string
		owner  uint64
		future *futures.Future[string]
	}
)

// acquireEnvelope and unlockEnvelope hold a request and its future in one
// allocation, for the hot paths (AcquireWait, Unlock): the request is sent as a
// pointer (*acquireMsg, *unlockMsg), which boxes into a message without a copy.
// The loop reads the request once, on arrival; the future stays shared with the
// caller, as New's would be.
type (
	acquireEnvelope struct {
		msg    acquireMsg
		future futures.Future[error]
	}
	unlockEnvelope struct {
		msg    unlockMsg
		future futures.Future[error]
	}
)

// forceResult is ForceUnlock's outcome.
type forceResult struct {
	existed bool
	err     error
}

// Notifications, posted to the mailbox (a scriptDone only by the unbatched
// runners' goroutines, runScript; a sender or runDirect steps its own; an
// unlockNotice only when the engine is busy, see Engine.stepNotice).
type (
	// cancelMsg: a waiter's context ended.
	cancelMsg struct {
		id  uint64
		err error
	}
	// scriptDone: a script call returned.
	scriptDone struct {
		call   scriptCall
		sentAt time.Time // monotonic; when the call was handed to rueidis
		reply  scripts.Reply
		err    error
	}
	// subscribeDone: a Subscribe call returned.
	subscribeDone struct {
		lock uint64
		err  error
	}
	// unsubscribeDone: an Unsubscribe call returned.
	unsubscribeDone struct{ lock uint64 }
	// timerFired: a timer entry fired.
	timerFired struct{ key timer.Key }
	// unlockNotice: a message arrived on an unlock channel.
	unlockNotice struct{ channel, payload string }
	// resubscribed: the pub/sub connection was replaced; messages may have been lost.
	resubscribed struct{}
	// abandonMsg: an owner-guarded cleanup that waited for the owner's call in
	// flight (parkCleanup: a give-back of releaseOne, a lost hold's release, one
	// behind an early handoff to the owner); never posted to the mailbox.
	abandonMsg struct {
		lock  uint64 // the lock's id: the handoff in flight keeps its state live
		owner uint64
		field string
		drop  int
		// keepHeld: the release is bounded by the count the owner's hold keeps when
		// it is sent (lock_release_owner.lua's ARGV[4]), so a retry takes no more.
		keepHeld bool
		// afterLoss: the release of a lost hold's field that waited for the owner's
		// call in flight (see releaseLost); it goes only if that call did not take
		// the field again.
		afterLoss bool
		relayed   *relay // the relay whose Unlocks its reply answers (see relay.go), or nil
		// leave: a fair leave of the owner's entry (field) that waited for the
		// owner's acquire in flight (see fairLeaveOwner).
		leave bool
	}
)

func (acquireMsg) isMessage()      {}
func (unlockMsg) isMessage()       {}
func (forceUnlockMsg) isMessage()  {}
func (lostMsg) isMessage()         {}
func (closeMsg) isMessage()        {}
func (settleMsg) isMessage()       {}
func (fieldMsg) isMessage()        {}
func (statsMsg) isMessage()        {}
func (cancelMsg) isMessage()       {}
func (scriptDone) isMessage()      {}
func (subscribeDone) isMessage()   {}
func (unsubscribeDone) isMessage() {}
func (timerFired) isMessage()      {}
func (unlockNotice) isMessage()    {}
func (resubscribed) isMessage()    {}
func (abandonMsg) isMessage()      {}
