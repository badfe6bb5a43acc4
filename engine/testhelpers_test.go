package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// This file holds the helpers of the state-machine tests (layer 1): a harness that
// drives a machine with messages at a controlled time and reads back the effects
// of each step. The engine-level fakes (script runner, subscriber, scheduler) live
// in fakes_test.go.

const testClientID = "cid"

// testConfig is the machine configuration the tests start from: Redisson's 30 s
// watchdog, the engine's default handoff bounds, and no linger (so an idle lock
// unsubscribes at once and the effects stay short).
func testConfig() config {
	return config{
		clientID:     testClientID,
		watchdog:     30 * time.Second,
		handoffChain: 16,
		handoffAge:   5 * time.Millisecond,
		linger:       0,
	}
}

// mh drives one machine. now only moves when a test moves it.
type mh struct {
	t      *testing.T
	m      *machine
	now    time.Time
	nextID uint64
}

func newMH(t *testing.T, mutate ...func(*config)) *mh {
	t.Helper()
	cfg := testConfig()
	for _, f := range mutate {
		f(&cfg)
	}
	return &mh{t: t, m: newMachine(cfg), now: time.Unix(1_000_000, 0)}
}

// tw is one test waiter: the caller's side of an acquireMsg.
type tw struct {
	id     uint64
	lock   string
	owner  uint64
	ctx    context.Context
	cancel context.CancelFunc
	future *futures.Future[error]
	stops  atomic.Int32 // calls of the AfterFunc unregistration
}

// acquire sends an acquireMsg with a cancellable context (so the machine keeps a
// stop function, as it does for every real caller with a cancellable context).
func (h *mh) acquire(lock string, owner uint64, lease, wait time.Duration) *tw {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h.t.Cleanup(cancel)
	h.nextID++
	w := &tw{id: h.nextID, lock: lock, owner: owner, ctx: ctx, cancel: cancel, future: futures.New[error]()}
	h.m.handle(acquireMsg{
		id: w.id, lock: lock, owner: owner, lease: lease, wait: wait, ctx: ctx,
		stop:   func() bool { w.stops.Add(1); return true },
		future: w.future,
	}, h.now)
	return w
}

// cancelCtx ends w's context and delivers the cancelMsg its AfterFunc would post.
func (h *mh) cancelCtx(w *tw) {
	w.cancel()
	h.m.handle(cancelMsg{id: w.id, err: w.ctx.Err()}, h.now)
}

// unlock sends an unlockMsg and returns its future.
func (h *mh) unlock(lock string, owner uint64) *futures.Future[error] {
	f := futures.New[error]()
	h.m.handle(unlockMsg{lock: lock, owner: owner, future: f}, h.now)
	return f
}

// unlockCall sends an unlockMsg and returns the one script call it made, which
// must run id, and the unlock's future.
func (h *mh) unlockCall(t *testing.T, lock string, owner uint64, id scripts.ID) (scriptCall, *futures.Future[error]) {
	t.Helper()
	h.take()
	f := h.unlock(lock, owner)
	return h.take().one(t, id), f
}

// reply delivers a script's reply, sent at h.now.
// settle sends a Settle for owner on lock and returns its future.
func (h *mh) settle(lock string, owner uint64) *futures.Future[error] {
	f := futures.New[error]()
	h.m.handle(settleMsg{lock: lock, owner: owner, future: f}, h.now)
	return f
}

func (h *mh) reply(call scriptCall, r scripts.Reply, err error) {
	h.replyAt(call, h.now, r, err)
}

func (h *mh) replyAt(call scriptCall, sentAt time.Time, r scripts.Reply, err error) {
	h.m.handle(scriptDone{call: call, sentAt: sentAt, reply: r, err: err}, h.now)
}

func (h *mh) notice(lock string) {
	h.m.handle(unlockNotice{channel: channelName(lock), payload: unlockMessage}, h.now)
}

func (h *mh) fire(key timer.Key) { h.m.handle(timerFired{key: key}, h.now) }

func (h *mh) subscribed(lock string) {
	h.m.handle(subscribeDone{lock: h.lockID(lock)}, h.now)
}

func (h *mh) lock(name string) *lockState {
	h.t.Helper()
	l := h.m.locks[name]
	if l == nil {
		h.t.Fatalf("no local state for lock %q", name)
	}
	return l
}

func (h *mh) lockID(name string) uint64 { return h.lock(name).id }

func (h *mh) hold(lock string, owner uint64) *hold {
	l := h.m.locks[lock]
	if l == nil {
		return nil
	}
	return h.m.holds[holdKey{l.id, owner}]
}

// queueIDs lists a lock's queued waiter ids, head first.
func (h *mh) queueIDs(lock string) []uint64 {
	l := h.m.locks[lock]
	if l == nil {
		return nil
	}
	var ids []uint64
	for w := l.queue.head; w != nil; w = w.next {
		ids = append(ids, w.id)
	}
	return ids
}

// Replies as the scripts send them.
var (
	replyNil = scripts.Reply{Nil: true}
	errConn  = errors.New("test: connection reset")
)

func replyInt(n int64) scripts.Reply          { return scripts.Reply{Int: n} }
func replyInts(n ...int64) scripts.Reply      { return scripts.Reply{Ints: n} }
func replyPTTL(d time.Duration) scripts.Reply { return replyInt(d.Milliseconds()) }

// step is the effects of one or more machine steps, copied out of the machine.
type step struct {
	scripts []scriptCall
	timers  []timerOp
	subs    []subOp
}

// take returns the effects appended since the last take and clears them.
func (h *mh) take() step {
	s := step{
		scripts: slices.Clone(h.m.fx.scripts),
		timers:  slices.Clone(h.m.fx.timers),
		subs:    slices.Clone(h.m.fx.subs),
	}
	h.m.fx.reset()
	return s
}

func (s step) calls(id scripts.ID) []scriptCall {
	var out []scriptCall
	for _, c := range s.scripts {
		if c.script == id {
			out = append(out, c)
		}
	}
	return out
}

// armed returns the arming (not cancelling) timer ops of kind, in order.
func (s step) armed(kind uint8) []timerOp {
	var out []timerOp
	for _, op := range s.timers {
		if op.key.Kind == kind && !op.cancel {
			out = append(out, op)
		}
	}
	return out
}

func (s step) cancelled(kind uint8) []timerOp {
	var out []timerOp
	for _, op := range s.timers {
		if op.key.Kind == kind && op.cancel {
			out = append(out, op)
		}
	}
	return out
}

func (s step) subscribes() []subOp {
	var out []subOp
	for _, op := range s.subs {
		if !op.unsubscribe {
			out = append(out, op)
		}
	}
	return out
}

func (s step) unsubscribes() []subOp {
	var out []subOp
	for _, op := range s.subs {
		if op.unsubscribe {
			out = append(out, op)
		}
	}
	return out
}

func (s step) String() string {
	var b []byte
	for _, c := range s.scripts {
		b = fmt.Appendf(b, "script %v keys=%v args=%v waiter=%d; ", c.script, c.keys, c.args, c.waiter)
	}
	for _, op := range s.timers {
		b = fmt.Appendf(b, "timer %+v d=%v cancel=%v; ", op.key, op.d, op.cancel)
	}
	for _, op := range s.subs {
		b = fmt.Appendf(b, "sub %s unsubscribe=%v; ", op.channel, op.unsubscribe)
	}
	return string(b)
}

// one returns the only script call of s, failing unless there is exactly one and it
// runs id.
func (s step) one(t *testing.T, id scripts.ID) scriptCall {
	t.Helper()
	if len(s.scripts) != 1 || s.scripts[0].script != id {
		t.Fatalf("want exactly one %v script call, got: %v", id, s)
	}
	return s.scripts[0]
}

// none fails if s ran any script.
func (s step) none(t *testing.T) {
	t.Helper()
	if len(s.scripts) != 0 {
		t.Fatalf("want no script call, got: %v", s)
	}
}

// retryArmed returns the last retry timer armed in s, failing if none was.
func (s step) retryArmed(t *testing.T) timerOp {
	t.Helper()
	ops := s.armed(kindRetry)
	if len(ops) == 0 {
		t.Fatalf("want a retry timer armed, got: %v", s)
	}
	return ops[len(ops)-1]
}

// ---- futures ----

// peek receives the future's value if it has one, without blocking.
func peek(f *futures.Future[error]) (error, bool) {
	select {
	case err := <-f.C():
		return err, true
	default:
		return nil, false
	}
}

func mustPending(t *testing.T, what string, f *futures.Future[error]) {
	t.Helper()
	if err, ok := peek(f); ok {
		t.Fatalf("%s: completed with %v, want still pending", what, err)
	}
}

// mustGet receives the future's value, failing if it has none yet.
func mustGet(t *testing.T, what string, f *futures.Future[error]) error {
	t.Helper()
	err, ok := peek(f)
	if !ok {
		t.Fatalf("%s: not completed", what)
	}
	return err
}

func mustGranted(t *testing.T, what string, f *futures.Future[error]) {
	t.Helper()
	if err := mustGet(t, what, f); err != nil {
		t.Fatalf("%s: got %v, want nil (granted)", what, err)
	}
}

func mustFired(t *testing.T, what string, c <-chan struct{}) {
	t.Helper()
	select {
	case <-c:
	default:
		t.Fatalf("%s: signal not closed", what)
	}
}

func mustNotFired(t *testing.T, what string, c <-chan struct{}) {
	t.Helper()
	select {
	case <-c:
		t.Fatalf("%s: signal closed, want open", what)
	default:
	}
}

// ---- scenario shortcuts ----

// heldElsewhere takes a fresh waiter on lock through its first refused attempt
// (the lock held by another process for pttl) and its subscription, so it is parked
// at the head: subscribed, retry timer armed, nothing in flight. It returns the
// waiter; the effects are consumed.
func (h *mh) heldElsewhere(lock string, owner uint64, wait, pttl time.Duration) *tw {
	h.t.Helper()
	w := h.acquire(lock, owner, 0, wait)
	att := h.take().one(h.t, scripts.LockAcquire)
	h.reply(att, replyPTTL(pttl), nil)
	h.parkedAfterRefusal(lock)
	h.subscribed(lock)
	s := h.take()
	if len(s.scripts) != 1 {
		h.t.Fatalf("setup: subscribeDone made %d script calls, want the head's one retry: %v", len(s.scripts), s)
	}
	// subscribeDone retries once; that retry is refused too.
	h.reply(s.scripts[0], replyPTTL(pttl), nil)
	h.parkedAfterRefusal(lock)
	mustPending(h.t, "parked waiter", w.future)
	return w
}

// parkedAfterRefusal consumes the effects of a refusal and fails the test (as a
// setup failure, pointing at the test that isolates the cause) if the refusal did
// not leave the head parked.
func (h *mh) parkedAfterRefusal(lock string) {
	h.t.Helper()
	if s := h.take(); len(s.scripts) != 0 {
		h.t.Fatalf("setup: a refused attempt on %q was followed at once by another script call, so the head "+
			"never parks (see TestMachineRefusalParks): %v", lock, s)
	}
}

// attemptAfterRelease returns the local head's attempt after this process released
// lock to everyone: made at once, or on the unlock message the release published
// (the design lets the head compete on that message with other processes' heads;
// both are correct, and the notice is delivered only if nothing ran at once).
func (h *mh) attemptAfterRelease(t *testing.T, lock string) scriptCall {
	t.Helper()
	s := h.take()
	if len(s.scripts) == 0 {
		h.notice(lock)
		s = h.take()
	}
	return s.one(t, scripts.LockAcquire)
}

// grantFresh acquires lock for owner on a free lock and returns the waiter, with
// the effects consumed.
func (h *mh) grantFresh(lock string, owner uint64, lease time.Duration) *tw {
	h.t.Helper()
	w := h.acquire(lock, owner, lease, -1)
	att := h.take().one(h.t, scripts.LockAcquire)
	h.reply(att, replyNil, nil)
	h.take()
	mustGranted(h.t, "grant on a free lock", w.future)
	return w
}

// live reports whether the machine has a lock state for name that is in use (not
// kept idle for reuse, see locks.go).
func (h *mh) live(name string) bool {
	l := h.m.locks[name]
	return l != nil && !l.idle
}
