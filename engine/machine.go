package engine

import (
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

// machine is the engine's pure state machine: every method runs on the loop
// goroutine, takes the time as an argument, blocks on nothing, and appends effects.
type machine struct {
	cfg config

	locks         map[string]*lockState
	lockByID      map[uint64]*lockState
	lockByChannel map[string]*lockState
	waiters       map[uint64]*waiter  // waiters not yet completed, by id
	receipts      map[uint64]*receipt // grants whose context is still watched, by waiter id
	holds         map[holdKey]*hold
	holdByID      map[uint64]*hold

	nextID        uint64 // ids of locks and holds
	watchdogHolds int    // holds renewed by the watchdog
	sweepArmed    bool
	closing       bool
	stats         Stats
	fx            effects
	now           time.Time // the time of the message being handled
}

func newMachine(cfg config) *machine {
	return &machine{
		cfg:           cfg,
		locks:         make(map[string]*lockState),
		lockByID:      make(map[uint64]*lockState),
		lockByChannel: make(map[string]*lockState),
		waiters:       make(map[uint64]*waiter),
		receipts:      make(map[uint64]*receipt),
		holds:         make(map[holdKey]*hold),
		holdByID:      make(map[uint64]*hold),
	}
}

// handle dispatches one message.
func (m *machine) handle(msg message, now time.Time) {
	m.now = now
	switch msg := msg.(type) {
	case acquireMsg:
		m.onAcquire(msg, now)
	case unlockMsg:
		m.onUnlock(msg, now)
	case forceUnlockMsg:
		m.onForceUnlock(msg, now)
	case lostMsg:
		m.onLost(msg)
	case closeMsg:
		m.onClose()
	case statsMsg:
		msg.future.Complete(m.snapshot())
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
		m.onUnlockNotice(msg.channel, now)
	case resubscribed:
		m.onResubscribed(now)
	}
}

// lockState is one lock's local state in this process.
type lockState struct {
	id      uint64
	name    string
	channel string
	fair    *fairKeys // nil for the reentrant lock

	queue queue // waiters in arrival order; the head is the one that retries

	// attempting is the queued waiter whose acquire (or handoff) is in flight; at
	// most one per lock, so one unlock message costs one script call per process.
	attempting *waiter
	// wakePending records an unlock message or TTL deadline that arrived while an
	// attempt was in flight: the attempt may have run before the release, so the
	// head must retry once more if it failed.
	wakePending bool
	// parked: the head was refused (or this process holds the lock) and waits for
	// an unlock message or its retry timer; nothing else makes it retry, so a
	// waiting lock costs no Redis calls at all.
	parked   bool
	inflight int // script calls in flight that name this lock
	// leaving counts fair_leave calls in flight per owner (fair locks only).
	leaving map[uint64]int

	sub        subState
	resubAfter bool   // subscribe again once the unsubscribe in flight is done
	retryGen   uint64 // generation of the armed retry timer; 0 = none armed
	lingerGen  uint64
	backoff    time.Duration
	backingOff bool // a transport error: no attempt until the retry timer fires

	holders []*hold // local holds of this lock (one for an exclusive lock)
	// chain counts local handoffs since the lock was last released to everyone;
	// chainStart is when that chain began.
	chain      int
	chainStart time.Time
}

type subState uint8

const (
	subNone subState = iota
	subSubscribing
	subSubscribed
	subUnsubscribing
)

func (m *machine) lockFor(name string, fair bool) *lockState {
	if l := m.locks[name]; l != nil {
		return l
	}
	m.nextID++
	l := &lockState{id: m.nextID, name: name, channel: channelName(name)}
	if fair {
		k := newFairKeys(name, m.cfg.clientID)
		l.fair = &k
	}
	m.locks[name] = l
	m.lockByID[l.id] = l
	m.lockByChannel[l.channel] = l
	return l
}

// maybeForget drops a lock's state once nothing refers to it.
func (m *machine) maybeForget(l *lockState) {
	if l.queue.len > 0 || len(l.holders) > 0 || l.attempting != nil || l.inflight > 0 || l.sub != subNone {
		return
	}
	if l.retryGen != 0 {
		m.cancelTimer(timer.Key{Kind: kindRetry, ID: l.id, Gen: l.retryGen})
	}
	delete(m.locks, l.name)
	delete(m.lockByID, l.id)
	delete(m.lockByChannel, l.channel)
}

// ---- effects helpers ----

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

// ---- acquire ----

func (m *machine) onAcquire(msg acquireMsg, now time.Time) {
	if m.closing {
		m.complete(msg.future, msg.stop, WrapError(msg.lock, ErrClosed))
		return
	}
	if err := msg.ctx.Err(); err != nil {
		m.complete(msg.future, msg.stop, err)
		return
	}
	l := m.lockFor(msg.lock, msg.fair)
	if (l.fair != nil) != msg.fair {
		m.complete(msg.future, msg.stop, WrapError(msg.lock, errKindMismatch))
		m.maybeForget(l)
		return
	}
	w := &waiter{
		id:     msg.id,
		lock:   l,
		owner:  msg.owner,
		lease:  msg.lease,
		ctx:    msg.ctx,
		stop:   msg.stop,
		future: msg.future,
	}
	if msg.wait > 0 {
		w.deadline = now.Add(msg.wait)
		m.schedule(timer.Key{Kind: kindWait, ID: w.id}, msg.wait)
	}
	m.waiters[w.id] = w
	m.stats.Acquires++

	// A holder re-entering, and a single try (wait 0, as sync.Mutex.TryLock), go
	// straight to Redis: queueing a holder behind waiters that wait for it would
	// deadlock, and a single try has nothing to wait for.
	if m.holds[holdKey{l.id, w.owner}] != nil || msg.wait == 0 {
		w.oneShot = msg.wait == 0
		w.direct = true
		m.attempt(w, now)
		return
	}
	l.queue.push(w)
	m.advance(l, now)
}

// advance starts the head's attempt when nothing is in flight and the lock may be
// free. When this process holds the lock itself, the head waits: the holder's
// Unlock hands over, and the retry timer covers a holder whose lease runs out.
func (m *machine) advance(l *lockState, now time.Time) {
	m.pruneCancelled(l)
	if l.backingOff {
		return
	}
	if l.fair != nil {
		m.fairAdvance(l, now)
		return
	}
	if l.attempting != nil || l.queue.head == nil || m.closing {
		return
	}
	if l.wakePending {
		m.startAttempt(l, now)
		return
	}
	if l.parked {
		return
	}
	if len(l.holders) > 0 {
		m.park(l, m.localHoldTTL(l, now), now)
		return
	}
	m.startAttempt(l, now)
}

// mayBeFree records that the lock may have become free (a local hold ended without
// a release message, a force-release): a parked head retries.
func (m *machine) mayBeFree(l *lockState) { l.parked = false }

// pruneCancelled answers queued waiters at the front whose context has already
// ended, before their cancellation message arrives: handing the lock to one of them
// would only cost a grant and a release.
func (m *machine) pruneCancelled(l *lockState) {
	for w := l.queue.head; w != nil && !w.attempting; w = l.queue.head {
		err := w.ctx.Err()
		if err == nil {
			return
		}
		m.finish(w, err)
	}
}

func (m *machine) startAttempt(l *lockState, now time.Time) {
	w := l.queue.head
	l.attempting = w
	l.wakePending = false
	l.parked = false
	m.attempt(w, now)
}

func (m *machine) attempt(w *waiter, now time.Time) {
	w.attempting = true
	m.stats.Attempts++
	if w.lock.fair != nil {
		m.fairAttempt(w, now)
		return
	}
	m.run(scriptCall{
		script:  scripts.LockAcquire,
		keys:    []string{w.lock.name},
		args:    []string{millis(m.leaseOf(w.lease)), ownerField(m.cfg.clientID, w.owner)},
		purpose: purposeAttempt,
		lock:    w.lock.id,
		waiter:  w.id,
	})
}

func (m *machine) leaseOf(lease time.Duration) time.Duration {
	if lease > 0 {
		return lease
	}
	return m.cfg.watchdog
}

// park makes sure a lock with waiters hears about releases: its channel subscribed,
// and a retry timer armed for when the holder's lease could run out (a holder that
// dies publishes nothing).
func (m *machine) park(l *lockState, ttl time.Duration, now time.Time) {
	l.parked = true
	m.subscribe(l)
	if w := l.queue.head; w != nil && !w.deadline.IsZero() {
		ttl = min(ttl, w.deadline.Sub(now))
	}
	m.armRetry(l, ttl)
}

func (m *machine) armRetry(l *lockState, d time.Duration) {
	if l.retryGen != 0 {
		m.cancelTimer(timer.Key{Kind: kindRetry, ID: l.id, Gen: l.retryGen})
	}
	m.nextID++
	l.retryGen = m.nextID
	m.schedule(timer.Key{Kind: kindRetry, ID: l.id, Gen: l.retryGen}, d)
}

func (m *machine) disarmRetry(l *lockState) {
	if l.retryGen != 0 {
		m.cancelTimer(timer.Key{Kind: kindRetry, ID: l.id, Gen: l.retryGen})
		l.retryGen = 0
	}
}

// localHoldTTL is how long until the earliest local hold of l could expire.
func (m *machine) localHoldTTL(l *lockState, now time.Time) time.Duration {
	ttl := m.cfg.watchdog
	for _, h := range m.holdsOf(l) {
		ttl = min(ttl, h.expiresAt.Sub(now))
	}
	return max(ttl, 0)
}

// onAttemptDone reads an acquire reply: nil = held, an integer = the lock's PTTL.
func (m *machine) onAttemptDone(d scriptDone, now time.Time) {
	l := m.lockByID[d.call.lock]
	w := m.waiters[d.call.waiter]
	if l != nil && l.attempting != nil && l.attempting.id == d.call.waiter {
		l.attempting = nil
	}
	granted := d.err == nil && d.reply.Nil
	if w == nil {
		// The waiter is gone (cancelled, closed): give back what the script granted.
		if granted && l != nil {
			m.abandon(l, d.call.args[1], 1)
		}
		if l != nil {
			m.advance(l, now)
			m.maybeForget(l)
		}
		return
	}
	w.attempting = false
	switch {
	case granted:
		l.chain = 0 // a normal acquisition ends any chain of local handoffs
		m.grant(w, d.sentAt, now)
	case d.err != nil:
		m.attemptFailed(w, d.err, now)
	case l.fair != nil:
		m.fairRefused(w, time.Duration(d.reply.Int)*time.Millisecond, now)
	default:
		m.attemptRefused(w, time.Duration(d.reply.Int)*time.Millisecond, now)
	}
	m.advance(l, now)
	m.maybeForget(l)
}

func (m *machine) attemptFailed(w *waiter, err error, now time.Time) {
	l := w.lock
	if isRedisError(err) || w.oneShot || w.expired || w.cancelErr != nil || m.closing {
		// A Redis error reply (wrong type, script error, no auth) will not go away by
		// retrying; a waiter out of time or cancelled gets its answer now.
		if w.cancelErr != nil {
			err = w.cancelErr
		}
		m.finish(w, err)
		return
	}
	// A transport error: the server may come back. Keep the waiter, retry with backoff.
	w.lastErr = err
	if w.direct {
		// A re-entering holder must not queue behind waiters that wait for it.
		w.direct = false
		l.queue.pushFront(w)
	}
	l.backoff = min(max(2*l.backoff, minBackoff), maxBackoff)
	l.backingOff = true
	m.armRetry(l, l.backoff)
}

func (m *machine) attemptRefused(w *waiter, ttl time.Duration, now time.Time) {
	l := w.lock
	l.backoff = 0
	l.backingOff = false
	switch {
	case w.cancelErr != nil:
		m.finish(w, w.cancelErr)
		return
	case w.oneShot || w.expired:
		m.finish(w, ErrNotAcquired)
		return
	}
	if w.direct {
		// A holder re-entering was refused: its hold is gone on the server. It waits
		// like anyone else now.
		w.direct = false
		l.queue.push(w)
	}
	if l.queue.head != w {
		return
	}
	if l.wakePending {
		return // advance retries at once
	}
	switch {
	case ttl == -2*time.Millisecond: // the key vanished between the checks: advance retries at once
		m.subscribe(l)
		return
	case ttl < 0: // exists without an expiry
		ttl = noTTLRetry
	}
	m.park(l, ttl, now)
}

// grant records a hold for w and completes its future.
func (m *machine) grant(w *waiter, sentAt, now time.Time) {
	l := w.lock
	l.wakePending = false
	if w.inQueue() {
		l.queue.remove(w)
	}
	delete(m.waiters, w.id)
	m.cancelWait(w)
	w.enqueued = false // the script took it out of the Redis queue
	if w.retryGen != 0 {
		m.cancelTimer(timer.Key{Kind: kindFairRetry, ID: w.id, Gen: w.retryGen})
	}
	h := m.addHold(l, w.owner, w.lease, sentAt, now)
	m.stats.Grants++

	err := w.cancelErr
	if err == nil {
		err = w.ctx.Err()
	}
	if err != nil {
		// The caller's context ended before the grant: it gets the context's error,
		// and the grant goes back at once.
		if w.stop != nil {
			w.stop()
		}
		w.future.Complete(WrapError(l.name, err))
		m.releaseOne(h)
		return
	}
	w.future.Complete(nil)
	if w.stop != nil {
		// The caller may still walk away without receiving (a select that took
		// another case, then cancelled): keep watching its context until the hold
		// ends, and take the grant back if it is still unreceived then.
		m.pruneReceipts(h)
		r := &receipt{id: w.id, future: w.future, stop: w.stop, hold: h.id}
		m.receipts[r.id] = r
		h.receipts = append(h.receipts, r.id)
	}
	switch {
	case l.queue.len == 0:
		m.queueEmptied(l)
	case l.fair == nil:
		m.park(l, m.leaseOf(w.lease), now)
	}
}

// queueEmptied: the lock's last local waiter is gone. Nothing needs its retry timer
// now, and its subscription lingers briefly, then goes.
func (m *machine) queueEmptied(l *lockState) {
	l.backingOff = false // the back-off belonged to a waiter that is gone
	l.parked = false
	l.wakePending = false
	m.disarmRetry(l)
	m.lingerOrUnsubscribe(l)
}

// finish completes a waiter that did not get the lock.
func (m *machine) finish(w *waiter, err error) {
	l := w.lock
	if w.inQueue() {
		l.queue.remove(w)
	}
	delete(m.waiters, w.id)
	m.cancelWait(w)
	if w.enqueued {
		m.fairLeave(w)
	}
	if w.stop != nil {
		w.stop()
	}
	if err == ErrNotAcquired && w.lastErr != nil {
		err = w.lastErr
	}
	w.future.Complete(WrapError(l.name, err))
	if l.queue.len == 0 {
		m.queueEmptied(l)
	}
}

func (m *machine) cancelWait(w *waiter) {
	if !w.deadline.IsZero() {
		m.cancelTimer(timer.Key{Kind: kindWait, ID: w.id})
	}
}

// complete answers a request that never became a waiter.
func (m *machine) complete(f *futures.Future[error], stop func() bool, err error) {
	if stop != nil {
		stop()
	}
	f.Complete(err)
}

// onCancel: a waiter's context ended. A waiter still queued leaves at once; one
// whose attempt is in flight is answered when the reply comes; a grant already sent
// is taken back if nobody received it.
func (m *machine) onCancel(msg cancelMsg, now time.Time) {
	if w := m.waiters[msg.id]; w != nil {
		if w.attempting {
			w.cancelErr = msg.err
			return
		}
		l := w.lock
		m.finish(w, msg.err)
		m.advance(l, now)
		m.maybeForget(l)
		return
	}
	r := m.receipts[msg.id]
	if r == nil {
		return
	}
	delete(m.receipts, msg.id)
	h := m.holdByID[r.hold]
	if _, revoked := r.future.Revoke(msg.err); revoked && h != nil {
		m.stats.Revoked++
		m.releaseOne(h)
	}
}

// onUnlockNotice: one unlock message is one permit for the head waiter to retry.
func (m *machine) onUnlockNotice(channel string, now time.Time) {
	l := m.lockByChannel[channel]
	if l == nil {
		m.fairNotice(channel, now)
		return
	}
	if l.queue.head == nil || l.fair != nil {
		return
	}
	m.stats.Notices++
	if l.attempting != nil {
		l.wakePending = true
		return
	}
	m.startAttempt(l, now)
}

// onResubscribed: messages may have been lost while the pub/sub connection was
// down, so the head waiter of every lock with waiters retries.
func (m *machine) onResubscribed(now time.Time) {
	for _, l := range m.locks {
		if l.queue.head == nil {
			continue
		}
		if l.fair != nil {
			m.fairWakeFirst(l, now)
			continue
		}
		if l.attempting != nil {
			l.wakePending = true
			continue
		}
		m.startAttempt(l, now)
	}
}

// ---- subscriptions ----

func (m *machine) subscribe(l *lockState) {
	switch l.sub {
	case subNone:
		l.sub = subSubscribing
		m.stats.Subscribes++
		m.fx.subs = append(m.fx.subs, m.subOp(l, false))
	case subSubscribed:
		if l.lingerGen != 0 {
			m.cancelTimer(timer.Key{Kind: kindLinger, ID: l.id, Gen: l.lingerGen})
			l.lingerGen = 0
		}
	case subUnsubscribing:
		l.resubAfter = true
	}
}

func (m *machine) onSubscribed(msg subscribeDone, now time.Time) {
	l := m.lockByID[msg.lock]
	if l == nil {
		return
	}
	l.sub = subSubscribed
	if l.queue.len == 0 {
		m.lingerOrUnsubscribe(l)
		return
	}
	// A release between the refused attempt and the subscription went unheard:
	// retry once now that messages will arrive.
	switch {
	case l.fair != nil:
		m.fairWakeFirst(l, now)
	case l.attempting != nil:
		l.wakePending = true
	default:
		m.startAttempt(l, now)
	}
}

// lingerOrUnsubscribe keeps an idle lock's subscription for cfg.linger, so a lock
// that is busy on and off does not pay a subscribe and an unsubscribe each time.
func (m *machine) lingerOrUnsubscribe(l *lockState) {
	if l.sub != subSubscribed || l.queue.len > 0 {
		return
	}
	if m.closing || m.cfg.linger <= 0 {
		m.unsubscribe(l)
		return
	}
	if l.lingerGen == 0 {
		m.nextID++
		l.lingerGen = m.nextID
		m.schedule(timer.Key{Kind: kindLinger, ID: l.id, Gen: l.lingerGen}, m.cfg.linger)
	}
}

func (m *machine) unsubscribe(l *lockState) {
	l.sub = subUnsubscribing
	l.lingerGen = 0
	m.fx.subs = append(m.fx.subs, m.subOp(l, true))
}

// subOp names what a lock listens on: its unlock channel, or for a fair lock the
// pattern of this client's per-waiter channels.
func (m *machine) subOp(l *lockState, unsubscribe bool) subOp {
	if l.fair != nil {
		return subOp{lock: l.id, channel: l.fair.pattern, pattern: true, unsubscribe: unsubscribe}
	}
	return subOp{lock: l.id, channel: l.channel, unsubscribe: unsubscribe}
}

func (m *machine) onUnsubscribed(msg unsubscribeDone, now time.Time) {
	l := m.lockByID[msg.lock]
	if l == nil {
		return
	}
	l.sub = subNone
	if (l.resubAfter || l.queue.len > 0) && !m.closing {
		l.resubAfter = false
		m.subscribe(l)
		return
	}
	m.maybeForget(l)
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
		if l.attempting != nil {
			l.wakePending = true
			return
		}
		m.startAttempt(l, now)
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

// onScriptDone routes a script reply by the call's purpose.
func (m *machine) onScriptDone(d scriptDone, now time.Time) {
	if l := m.lockByID[d.call.lock]; l != nil {
		l.inflight--
	}
	switch d.call.purpose {
	case purposeAttempt:
		m.onAttemptDone(d, now)
	case purposeHandoff:
		m.onHandoffDone(d, now)
	case purposeUnlock:
		m.onUnlockDone(d, now)
	case purposeAbandon:
		if m.retryOnce(d) {
			return
		}
		if l := m.lockByID[d.call.lock]; l != nil {
			m.maybeForget(l)
		}
	case purposeForce:
		m.onForceDone(d, now)
	case purposeRenew:
		m.onRenewDone(d, now)
	case purposeLeave:
		if m.retryOnce(d) {
			return
		}
		m.onLeaveDone(d, now)
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
type Stats struct {
	Acquires, Attempts, Grants, Handoffs, Revoked, Notices uint64
	ScriptCalls, Renewals, Subscribes                      uint64
	Waiters, Holds, Locks, Receipts                        int
}

func (m *machine) snapshot() Stats {
	s := m.stats
	s.Waiters = len(m.waiters)
	s.Holds = len(m.holdByID)
	s.Locks = len(m.locks)
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
	m.sweepArmed = false
	m.cancelTimer(timer.Key{Kind: kindSweep})
}
