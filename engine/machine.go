package engine

import (
	"errors"
	"slices"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
	"github.com/redis/rueidis"
)

// config is the machine's fixed configuration.
type config struct {
	clientID string
	// watchdog is the lease of holds without an explicit one; they are renewed every
	// watchdog/3, as Redisson does (30 s lease, 10 s period by default).
	watchdog time.Duration
	// handoffChain and handoffAge bound local handoffs (see machine.canHandoff).
	handoffChain int
	handoffAge   time.Duration
	// linger is how long an idle lock keeps its subscription.
	linger time.Duration
	// fairWait is the fair lock's wait allowance: how long a queued waiter may be
	// gone before it loses its place (Redisson's fairLockWaitTimeout).
	fairWait time.Duration
	// publicYield: see yieldToPublic; 0 turns it off.
	publicYield time.Duration
}

// Retry and sweep constants.
const (
	minBackoff = 10 * time.Millisecond // first retry after a transport error
	maxBackoff = time.Second           // longest retry interval after transport errors
	// noTTLRetry is the retry interval when the lock exists without an expiry (a
	// foreign client's persistent key): there is no deadline to wait for.
	noTTLRetry = time.Second
	// renewBatch is how many holds one renewal call carries (Redisson: 100).
	renewBatch = 100
)

// machine is the engine's pure state machine: every method runs under the
// engine's mutex (on the loop goroutine, a caller's, a sender's or the pub/sub
// reader's: see Engine.tryDirect, Engine.sender, Engine.stepNotice),
// takes the time as an argument, blocks on nothing, and appends effects.
type machine struct {
	watchdogText string // millis(cfg.watchdog), for every script call of a watchdog hold
	fairWaitText string // millis(cfg.fairWait), for every fair script call
	cfg          config

	locks          map[string]*lockState
	lockByID       map[uint64]*lockState
	lockByChannel  map[string]*lockState
	waiters        map[uint64]*waiter  // waiters not yet completed, by id
	receipts       map[uint64]*receipt // grants whose context is still watched, by waiter id
	holds          map[holdKey]*hold
	serial         map[holdKey]*ownerCalls // owners with a direct acquire or a release in flight
	freeCalls      []*ownerCalls           // unused ownerCalls, for reuse (see maxFreeCalls)
	lostHolds      map[holdKey]struct{}    // owners whose last hold was lost, until they Unlock or hold again
	giveBacks      map[holdKey][]uint64    // owners' give-backs in flight, by sequence number (see giveback.go)
	giveBackSeq    uint64                  // the last give-back's sequence number
	afterGiveBacks map[holdKey][]parkedMsg // requests waiting for the owner's give-backs
	// boundedGiveBacks: owners with a give-back bounded by the counts they keep in
	// flight, and the ones waiting to follow it (see cleanUp).
	boundedGiveBacks map[holdKey][]scriptCall
	parkedAcquires   map[uint64]holdKey // direct acquires parked in either place, by waiter id (see parkAcquire)
	holdByID         map[uint64]*hold
	// leaseDoubts: holds whose lock's expiry a failed call of the owner's may have
	// shortened (see reentryMayHaveRun), by hold id.
	leaseDoubts   map[uint64]leaseDoubt
	leaveRetries  map[uint64]scriptCall // leaves waiting to be sent again, by timer id (see retryLeaveLater)
	leaveRetrySeq uint64

	nextID        uint64 // ids of locks and holds
	watchdogHolds int    // holds renewed by the watchdog
	sweepArmed    bool
	idleLocks     int          // lock states kept idle (see locks.go)
	idleQueue     []*lockState // states marked idle, each once (see onForget)
	// refusedNames: locks whose state was forgotten with refusedLast set; a new
	// state of the name takes it up (see lockFor). At most maxRefusedNames.
	refusedNames map[string]struct{}
	forgetArmed  bool // the idle states' timer is armed
	closing      bool
	// Direct grants of the reentrant lock (see directgrant.go): this client's grant
	// channel, its subscription, and the origin of registration stamps.
	grantChannel  string
	grantSub      subState
	epoch         time.Time
	claimedGrants map[uint64]struct{} // see noteClaimed
	// deferGrants: grants are completed by flushGrants, not at once (see deliver);
	// set by the Engine, left off by the machine's own tests.
	deferGrants bool
	grantsDue   []*futures.Future[error]
	stats       Stats
	fx          effects
	now         time.Time // the time of the message being handled
	// answering: the call whose reply is being read, until its owners are marked
	// idle (see ownCalls); zero otherwise. A copy of the few fields ownCalls reads,
	// not a pointer to the reply: that would move every reply to the heap.
	answering answeringCall
}

// answeringCall is what ownCalls needs of the call being answered (lock 0: none;
// lock ids start at 1).
type answeringCall struct {
	lock, owner, receiver uint64
	serial, handoff       bool
}

// ownCalls is how many of owner k's busy counts the call being answered holds:
// it is in flight no more.
func (m *machine) ownCalls(k holdKey) int {
	c := &m.answering
	if c.lock == 0 || c.lock != k.lock {
		return 0
	}
	n := 0
	if c.serial && c.owner == k.owner {
		n++
	}
	if c.handoff && c.receiver == k.owner {
		n++
	}
	return n
}

func newMachine(cfg config) *machine {
	return &machine{
		cfg:              cfg,
		locks:            make(map[string]*lockState),
		lockByID:         make(map[uint64]*lockState),
		lockByChannel:    make(map[string]*lockState),
		waiters:          make(map[uint64]*waiter),
		receipts:         make(map[uint64]*receipt),
		holds:            make(map[holdKey]*hold),
		serial:           make(map[holdKey]*ownerCalls),
		lostHolds:        make(map[holdKey]struct{}),
		giveBacks:        make(map[holdKey][]uint64),
		afterGiveBacks:   make(map[holdKey][]parkedMsg),
		boundedGiveBacks: make(map[holdKey][]scriptCall),
		parkedAcquires:   make(map[uint64]holdKey),
		holdByID:         make(map[uint64]*hold),
		leaseDoubts:      make(map[uint64]leaseDoubt),
		leaveRetries:     make(map[uint64]scriptCall),
		watchdogText:     millis(cfg.watchdog),
		fairWaitText:     millis(cfg.fairWait),
		grantChannel:     "leash_lock_grant:" + cfg.clientID,
		claimedGrants:    make(map[uint64]struct{}),
	}
}

// handle dispatches one message.
func (m *machine) handle(msg message, now time.Time) {
	m.begin(now)
	switch msg := msg.(type) {
	case acquireMsg:
		m.onAcquire(msg, now)
	case *acquireMsg: // from an acquireEnvelope
		m.onAcquire(*msg, now)
	case unlockMsg:
		m.onUnlock(msg, now)
	case *unlockMsg: // from an unlockEnvelope
		m.onUnlock(*msg, now)
	case forceUnlockMsg:
		m.onForceUnlock(msg, now)
	case lostMsg:
		m.onLost(msg)
	case closeMsg:
		m.onClose()
	case settleMsg:
		m.onSettle(msg)
	case statsMsg:
		msg.future.Complete(m.snapshot())
	case describeMsg:
		msg.future.Complete(m.describe(msg.lock, now))
	case fieldMsg:
		msg.future.Complete(m.holdField(msg.lock, msg.owner))
	case cancelMsg:
		m.onCancel(msg, now)
	case scriptDone:
		m.onScriptDone(msg, now)
	case subscribeDone:
		m.onSubscribed(msg, now)
	case unsubscribeDone:
		m.onUnsubscribed(msg, now)
	case timerFired:
		m.onTimer(msg.key, now)
	case unlockNotice:
		m.onUnlockNotice(msg.channel, msg.payload, now)
	case resubscribed:
		m.onResubscribed(now)
	case abandonMsg:
		// A give-back that waited for the owner's call in flight (releaseOne), or
		// one markIdle finds left (sendWaitingCleanups takes out those that wait
		// for an early handoff).
		m.runCleanup(msg)
	}
}

// handleDone is handle for a script reply, which Engine.step may have as one call
// of a batchDone rather than as a message.
func (m *machine) handleDone(d scriptDone, now time.Time) {
	m.begin(now)
	m.onScriptDone(d, now)
}

// begin is what handling every message starts with.
func (m *machine) begin(now time.Time) {
	m.now = now
	if len(m.grantsDue) > 0 {
		m.flushGrants() // a grant is complete before anything else is handled
	}
}

// lockState is one lock's local state in this process.
type lockState struct {
	id      uint64
	name    string
	channel string
	fair    *fairKeys // nil for the reentrant lock
	// nameKeys and releaseKeys are the KEYS of lock_acquire and of lock_release
	// and lock_handoff, made once; script calls share them read-only.
	nameKeys, releaseKeys []string
	// field is the owner field last made for a waiter of this lock, fieldOwner's
	// (see machine.waiterField).
	field      string
	fieldOwner uint64
	// refusedLast: the last attempt's reply from Redis here did not grant the lock
	// (it was held elsewhere, or a direct grant was claimed): the next first attempt
	// is not sent as fresh (scriptCall.fresh), which would likely cost a refused
	// plain command before the script. It outlives the state (refusedNames).
	refusedLast bool
	// quietLast: a hint that nobody else waits for the lock. It is set by a
	// lock_release or fair_release reply of 2 (nobody listened on the unlock
	// channel; nobody was queued), cleared by any other reply of theirs but 0 and
	// by a refused attempt; releases by the other scripts (handoffs, give-backs,
	// leaves) leave it as it is, and a refusal answered before a release sent
	// earlier is overridden by that release's reply. A last-count release may then
	// go as two plain commands (scriptCall.quiet), and a fair lock's first attempt
	// too (scriptCall.fresh). A wrong hint costs a registered waiter of another
	// client one PublicYield (plain lock); for a fair lock, a release the script
	// after its pair (a round trip), and a first attempt the give-back and the
	// script (two), the queue's head waiting meanwhile.
	quietLast bool

	queue queue // waiters in arrival order; the head is the one that retries

	// attempting is the queued waiter whose acquire (or handoff) is in flight; at
	// most one per lock, so one unlock message costs one script call per process.
	attempting *waiter
	// handingOff: a handoff that granted early is in flight (see handoff.go). The
	// queued waiters make no attempt meanwhile (fair ones only join; see fairAdvance), as
	// while attempting is set: an attempt could otherwise re-enter, take after a
	// force-release, or (fair) claim as an unheard grant a field the handoff is
	// about to swap or its cleanup to delete.
	handingOff bool
	// relay: the holders granted with no call while that handoff is in flight
	// (see relay.go); nil when there are none.
	relay *relay
	// wakePending records an unlock message or TTL deadline that arrived while an
	// attempt was in flight: the attempt may have run before the release, so the
	// head must retry once more if it failed.
	wakePending bool
	// parked: the head was refused (or this process holds the lock) and waits for
	// something that says the lock may be free: an unlock message, its retry
	// timer, a (re)subscription, a local hold ending. Nothing else makes it retry,
	// so a waiting lock costs no Redis calls.
	parked   bool
	inflight int // script calls in flight that name this lock
	// renewsOut counts the watchdog's renewals of this lock's holds in flight, and
	// renewAnswered is when the last one was answered (or failed). A renewal
	// outlives its hold: it is a PEXPIRE guarded by the owner's field, and may run
	// after that owner's next acquire (see renewMayFollow). The state is kept
	// while renewsOut is above zero.
	renewsOut     int
	renewAnswered time.Time
	// forcedAt is when the last force-release of this lock that found it held was
	// answered: a hold granted by a call sent before then may have been deleted by
	// it (see checkForced).
	forcedAt time.Time
	// cleanupsWaiting counts owner-guarded releases of this lock parked behind an
	// owner's call in flight (parkCleanup): they need the state when they run.
	cleanupsWaiting int
	// leaving counts fair_leave calls in flight per owner (fair locks only).
	leaving map[uint64]int
	// joining counts a fair lock's first attempts in flight: local waiters joining
	// the Redis queue, a batch at a time (see fairAdvance).
	joining int
	// fairRun: the local waiters that the last fair handoff's reply said stand next
	// in the Redis queue, in order, after the holders the calls in flight hand
	// the lock to (see fairrun.go); a handoff or relay to fairRun[0] may grant
	// early. Waiter ids are never reused, so a stale one matches nobody.
	fairRun []uint64

	sub        subState
	resubAfter bool // subscribe again once the unsubscribe in flight is done
	// subLeft: a Subscribe failed, and the registry keeps such a channel and
	// subscribes it on its next connection (pubsub.Registry.Subscribe), so the
	// lock, though subNone, unsubscribes when its queue empties and is not
	// forgotten before; otherwise the server would keep the subscription for the
	// connection's life.
	subLeft    bool
	retryGen   uint64 // generation of the armed retry timer; 0 = none armed
	lingerGen  uint64
	backoff    time.Duration
	backingOff bool // a transport error: no attempt until the retry timer fires

	// yieldGen: the generation of the retry timer when it was armed as a yield to
	// unregistered listeners (see yieldToPublic); the yield is pending while the
	// timer still has it.
	yieldGen uint64

	// registered: an attempt registered a waiter for direct grants since the
	// subscription was made (see directgrant.go, queueEmptied).
	registered bool
	// mayBeRegistered: a call that registers a waiter of this client's was sent
	// since the last release that dropped the client's registration.
	mayBeRegistered bool

	holders []*hold // local holds of this lock (one for an exclusive lock)
	// chain counts local handoffs since the lock was last released to everyone;
	// chainStart is when that chain began.
	chain      int
	chainStart time.Time
	// othersQuietAt is when the last plain handoff whose reply said that nobody
	// but this client listened on the unlock channel was sent; zero when the
	// last such reply said somebody did (see noteListeners).
	othersQuietAt time.Time

	// idle: nothing refers to the state; it is kept for reuse since idleSince
	// (see locks.go).
	idle        bool
	idleSince   time.Time
	inIdleQueue bool // in machine.idleQueue
}

type subState uint8

const (
	subNone subState = iota
	subSubscribing
	subSubscribed
	subUnsubscribing
)

// ---- effects helpers ----

// deliver completes a grant's future with nil, or, with deferGrants, records it for
// flushGrants.
//
// Why defer: Go runs the goroutine readied last first on the same thread (its
// "runnext" slot). The engine readies the granted caller while handling a message
// and then starts the step's I/O goroutines, which would each take that slot and
// run before the caller, who is the one waiting. Completing grants after the I/O
// goroutines are started lets the caller run first (a sender that goes on with the
// next batch itself starts no goroutine for it); measured on the 2-core VM, the
// idle gap between one holder's Unlock and the next local holder's return fell from
// about 100 µs to 70 µs. Deferred grants are completed no later than the start of
// the next message, so nothing the machine does sees a grant half made (a
// cancellation's Revoke, a received check).
func (m *machine) deliver(f *futures.Future[error]) {
	if m.deferGrants {
		m.grantsDue = append(m.grantsDue, f)
		return
	}
	f.Complete(nil)
}

// flushGrants completes the grants deliver deferred.
func (m *machine) flushGrants() {
	for i, f := range m.grantsDue {
		f.Complete(nil)
		m.grantsDue[i] = nil
	}
	m.grantsDue = m.grantsDue[:0]
}

func (m *machine) run(call scriptCall) {
	if l := m.lockByID[call.lock]; l != nil {
		l.inflight++
	}
	m.stats.ScriptCalls++
	m.fx.scripts = append(m.fx.scripts, call)
}

func (m *machine) schedule(key timer.Key, d time.Duration) {
	m.fx.timers = append(m.fx.timers, timerOp{key: key, d: max(d, 0)})
}

func (m *machine) cancelTimer(key timer.Key) {
	m.fx.timers = append(m.fx.timers, timerOp{key: key, cancel: true})
}

// ---- timers ----

func (m *machine) onTimer(key timer.Key, now time.Time) {
	switch key.Kind {
	case kindRetry:
		l := m.lockByID[key.ID]
		if l == nil || l.retryGen != key.Gen {
			return // stale: re-armed or disarmed since
		}
		l.retryGen = 0
		l.backingOff = false
		if l.queue.head == nil {
			return
		}
		if l.fair != nil {
			m.fairWakeFirst(l, now)
			return
		}
		m.wakeHead(l, now)
	case kindWait:
		w := m.waiters[key.ID]
		if w == nil {
			return
		}
		if left := w.deadline.Sub(now); left > timer.Tick {
			m.schedule(key, left) // fired early (the wheel runs on the wall clock)
			return
		}
		if w.attempting {
			w.expired = true
			return
		}
		l := w.lock
		m.finish(w, ErrNotAcquired)
		m.advance(l, now)
		m.maybeForget(l)
	case kindFairRetry:
		m.onFairRetry(key, now)
	case kindExpiry:
		m.onExpiry(key.ID, now)
	case kindSweep:
		m.onSweep(now)
	case kindForget:
		m.onForget(now)
	case kindLeaveRetry:
		m.onLeaveRetry(key.ID)
	case kindLinger:
		l := m.lockByID[key.ID]
		if l == nil || l.lingerGen != key.Gen {
			return
		}
		l.lingerGen = 0
		if l.queue.len == 0 && l.sub == subSubscribed {
			m.unsubscribe(l)
		}
	}
}

// noteGiveBackUnknown marks the hold of a one-count give-back that failed (tried
// twice, see retryOnce) as maySurplus: the give-back may not have run, and the
// server may count one more than the engine. It runs before giveBackDone hands
// the requests that waited for the give-back back to handle: an Unlock among them
// must not grant a local waiter early on that hold (canGrantEarly).
func (m *machine) noteGiveBackUnknown(d scriptDone) {
	if d.err == nil || d.call.script != scripts.LockReleaseOwner || len(d.call.args) != 4 {
		return // answered, or not a give-back of one count of a hold kept (releaseOne)
	}
	if h := m.holds[holdKey{d.call.lock, d.call.owner}]; h != nil && h.field == d.call.args[1] {
		h.maySurplus = true
	}
}

// onScriptDone routes a script reply by the call's purpose.
func (m *machine) onScriptDone(d scriptDone, now time.Time) {
	if l := m.lockByID[d.call.lock]; l != nil {
		l.inflight--
	}
	switch {
	case d.call.purpose == purposeUnlock, d.call.purpose == purposeAbandon, d.call.purpose == purposeLeave,
		d.call.early:
		if m.retryOnce(d) || m.retryLeaveLater(d) {
			return // still in flight: the owner (and an early grant's receiver) stays busy
		}
	case d.call.purpose == purposeAttempt && errors.Is(d.err, scripts.ErrFreshRefused):
		if m.resendRefusedFresh(d) {
			return // still in flight, as the script now
		}
		// Nothing ran, for a waiter that no longer waits: answered as a refusal
		// that found the lock gone (as lock_acquire's -2), which settles it.
		d.err, d.reply = nil, scripts.Reply{Int: -2}
	}
	m.answering = answeringCall{ // until its owners are marked idle (see ownCalls)
		lock: d.call.lock, owner: d.call.owner, receiver: d.call.receiver,
		serial: d.call.serial, handoff: d.call.purpose == purposeHandoff,
	}
	if d.call.giveBack != 0 {
		m.nextBoundedGiveBack(d) // sent before anything the reply starts
		m.noteGiveBackUnknown(d) // before the requests that waited for it are handled
		m.giveBackDone(holdKey{d.call.lock, d.call.owner}, d.call.giveBack, now)
	}
	switch d.call.purpose {
	case purposeAttempt:
		m.onAttemptDone(d, now)
	case purposeHandoff:
		m.onHandoffDone(d, now)
	case purposeUnlock:
		m.onUnlockDone(d, now)
	case purposeAbandon:
		if d.call.relayed != nil {
			// -1 on a retry most likely means the first try ran (as in onUnlockDone),
			// unless the first is known not to have run.
			m.answerRelay(d.call.relayed, relayOutcome(d, d.reply.Int == -1 && (!d.call.retried || d.call.firstUnrun)))
		}
		if d.call.script == scripts.LockLeave {
			m.onLeaveRegDone(d, now)
			break
		}
		if l := m.lockByID[d.call.lock]; l != nil {
			if l.fair != nil {
				m.onLeaveDone(d, now) // see abandon
			} else {
				m.maybeForget(l)
			}
		}
	case purposeForce:
		m.onForceDone(d, now)
	case purposeRenew:
		m.onRenewDone(d, now)
	case purposeLeave:
		m.onLeaveDone(d, now)
	}
	m.answering = answeringCall{}
	if d.call.serial {
		m.markIdle(holdKey{d.call.lock, d.call.owner}, now)
	}
	if d.call.purpose == purposeHandoff {
		// Its receiver's calls waited for it: an early grant's (grantEarly) or a
		// waiter's handoff attempt (handoff).
		m.markIdle(holdKey{d.call.lock, d.call.receiver}, now)
	}
}

// retryOnce sends a release-type call again, once, after a transport error: a
// connection found dead on use (a restarted server), or a call that could not run in
// order (scripts.ErrReordered). It reports whether it did.
func (m *machine) retryOnce(d scriptDone) bool {
	if d.err == nil || d.call.retried || isRedisError(d.err) || m.closing {
		return false
	}
	retry := d.call
	retry.retried = true
	retry.firstSent = d.sentAt
	retry.firstUnrun = errors.Is(d.err, scripts.ErrReordered)
	switch {
	case retry.firstUnrun:
		// The retry is the first run: its arguments stay a first try's.
	case retry.early && retry.script == scripts.FairHandoff:
		// fair_handoff's ARGV[10]: tell a first try that ran from one that did not.
		retry.args = slices.Clone(retry.args)
		retry.args[9] = "1"
	case retry.early:
		// lock_handoff's ARGV[7], the same (its direct-grant arguments follow).
		retry.args = slices.Clone(retry.args)
		retry.args[6] = "1"
	}
	if !m.withoutStaleDrop(&retry) {
		return false // a leave that only dropped a registration: retryLeaveLater puts it off
	}
	m.run(retry)
	return true
}

// isRedisError tells an error reply of Redis (wrong type, script error, no auth),
// which retrying will not cure, from a transport error, which it may.
func isRedisError(err error) bool {
	_, ok := rueidis.IsRedisErr(err)
	return ok
}

// Stats is a snapshot of the engine's counters, for tests and metrics.
//
// DirectGrants counts grants made by another client's (or, for a fair lock, this
// one's) release and taken from their message or claimed, without a call of their
// own (see fair.go, directgrant.go); GrantsGivenBack counts the reentrant lock's
// direct grants that nobody could take. EarlyGrants counts local handoffs that
// granted before their reply (see handoff.go), relayed ones included; Relays counts
// those that needed no call of their own (see relay.go).
//
// SharedPlainCommands is not the engine's: a client (lockapi) fills it with its
// runner's count of plain commands sent that the scripts also run inside Lua
// (scripts.Redis.SharedCommandsSent), for tools that count requests from INFO
// commandstats.
type Stats struct {
	Acquires, Attempts, Grants, Handoffs, Revoked, Notices uint64
	DirectGrants, GrantsGivenBack, EarlyGrants, Relays     uint64
	ScriptCalls, Renewals, Subscribes                      uint64
	SharedPlainCommands                                    uint64
	Waiters, Holds, Locks, Receipts                        int
}

func (m *machine) snapshot() Stats {
	s := m.stats
	s.Waiters = len(m.waiters)
	s.Holds = len(m.holdByID)
	s.Locks = len(m.locks) - m.idleLocks
	s.Receipts = len(m.receipts)
	return s
}

// onClose fails every waiter with ErrClosed, closes the Lost signal of every hold
// and releases it (owner-guarded), and unsubscribes everything. The loop stops once
// the calls in flight have come back.
func (m *machine) onClose() {
	if m.closing {
		return
	}
	m.closing = true
	m.answerParkedOnClose()
	for _, q := range m.serial {
		pending := q.pending
		q.pending = nil
		for _, msg := range pending {
			if _, cleanup := msg.(abandonMsg); cleanup {
				q.pending = append(q.pending, msg) // still runs after the call it waits for
				continue
			}
			m.handle(msg, m.now) // answered ErrClosed
		}
	}
	for _, w := range m.waiters {
		if w.attempting {
			w.cancelErr = ErrClosed
			continue
		}
		m.finish(w, ErrClosed)
	}
	for _, h := range m.holdByID {
		m.loseHold(h, true)
	}
	for _, l := range m.locks {
		m.disarmRetry(l)
		if l.sub == subSubscribed {
			m.unsubscribe(l)
		}
	}
	m.unsubscribeGrants()
	m.sweepArmed = false
	m.cancelTimer(timer.Key{Kind: kindSweep})
	for id := range m.leaveRetries {
		m.cancelTimer(timer.Key{Kind: kindLeaveRetry, ID: id})
		m.onLeaveRetry(id) // once more now; Close waits for it
	}
}
