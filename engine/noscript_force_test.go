package engine

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// noScriptMem is batchMem whose first acquire models scripts.Redis.Run: EVALSHA
// is answered NOSCRIPT (the server's script cache was flushed), and EVAL goes
// after it, later, its send time reported as Reply.SentAt. Hooks let a test run
// a ForceUnlock between the two sends and hold the force-release's reply after
// it ran.
type noScriptMem struct {
	*batchMem
	once        sync.Once
	missed      chan struct{} // closed when the first acquire's EVALSHA met NOSCRIPT
	sendEval    chan struct{} // its EVAL waits for this
	forceRan    chan struct{}
	forceAnswer chan struct{}
}

func (r *noScriptMem) Run(ctx context.Context, id scripts.ID, keys, args []string) (scripts.Reply, error) {
	var evalAt time.Time
	if id == scripts.LockAcquire {
		first := false
		r.once.Do(func() { first = true })
		if first {
			close(r.missed)
			<-r.sendEval // EVAL after NOSCRIPT, sent now
			evalAt = time.Now()
		}
	}
	reply, err := r.batchMem.Run(ctx, id, keys, args)
	reply.SentAt = evalAt
	if id == scripts.LockForceRelease {
		close(r.forceRan)
		<-r.forceAnswer
	}
	return reply, err
}

func (r *noScriptMem) RunBatch(ctx context.Context, calls []scripts.Call, out []scripts.Result) []scripts.Result {
	out = out[:0]
	for _, c := range calls {
		rep, err := r.Run(ctx, c.ID, c.Keys, c.Args)
		out = append(out, scripts.Result{Reply: rep, Err: err})
	}
	return out
}

// TestNoScriptRetryForceUnlockBetween is TestFreshForceUnlockBetweenRestoreAndScript
// for the shared lane: the acquire's EVALSHA meets NOSCRIPT, this client's
// ForceUnlock is sent and runs (deleting another process's hold, or finding
// none), then the EVAL takes the free lock. The grant ran after the
// force-release: dated at the EVALSHA's send, before the force-release's, it
// would be dropped by the force-release's reply as its victim; it is dated at
// the EVAL's (Reply.SentAt).
func TestNoScriptRetryForceUnlockBetween(t *testing.T) {
	t.Run("heldElsewhere", func(t *testing.T) { testNoScriptRetryForce(t, true) })
	t.Run("free", func(t *testing.T) { testNoScriptRetryForce(t, false) })
}

// held: another process holds the lock, and the force-release deletes it; free:
// the force-release finds nothing.
func testNoScriptRetryForce(t *testing.T, held bool) {
	r := &noScriptMem{
		batchMem:    &batchMem{memRedis: newMemRedis()},
		missed:      make(chan struct{}),
		sendEval:    make(chan struct{}),
		forceRan:    make(chan struct{}),
		forceAnswer: make(chan struct{}),
	}
	h := newEngine(t, r)
	r.publish = h.sub.deliver
	if held {
		r.set("L", "other:1", 1, 10*time.Second)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	owner := h.e.NewOwner()
	acquired := make(chan error, 1)
	go func() { acquired <- h.e.AcquireWait(ctx, AcquireRequest{Lock: "L", Owner: owner, Wait: -1}) }()
	select {
	case <-r.missed:
	case <-time.After(5 * time.Second):
		t.Fatal("the acquire did not go")
	}
	type forced struct {
		existed bool
		err     error
	}
	forceDone := make(chan forced, 1)
	go func() {
		existed, err := h.e.ForceUnlock(ctx, "L", false)
		forceDone <- forced{existed, err}
	}()
	select {
	case <-r.forceRan:
	case <-time.After(5 * time.Second):
		t.Fatal("the force-release did not run")
	}
	close(r.sendEval)
	if err := recv(t, "acquire", acquired); err != nil {
		t.Fatalf("acquire: %v", err)
	}
	field := OwnerField(testClientID, owner)
	if got := r.holders("L"); got[field] != 1 || len(got) != 1 {
		t.Fatalf("server has %v, want %s=1", got, field)
	}
	close(r.forceAnswer)
	select {
	case f := <-forceDone:
		if f.err != nil || f.existed != held {
			t.Fatalf("ForceUnlock = %v, %v; want %v, nil", f.existed, f.err, held)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("ForceUnlock did not return")
	}
	if err := h.e.Settle(ctx, "L", owner); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the check's call answered", func() bool { return h.stats().Waiters == 0 })
	select {
	case <-h.e.Lost("L", owner):
		err := h.e.Unlock(ctx, "L", owner)
		t.Fatalf("the hold was dropped as lost (Unlock: %v) while the server holds it for %s: %v", err, field, r.holders("L"))
	default:
	}
	if err := h.e.Unlock(ctx, "L", owner); err != nil {
		t.Fatalf("unlock: %v", err)
	}
}
