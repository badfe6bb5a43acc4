package engine

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// A runner may answer an acquire with a command it sent after the call began:
// the script after a refused RESTORE (scripts.FreshRunner), an EVAL after
// NOSCRIPT. A ForceUnlock of this client's sent and run between the two sends
// cannot have deleted the grant; dated at the call's first send, before the
// force-release's, the grant would be ended by the force-release's reply as its
// victim, without a check. The runner reports the later send (Reply.SentAt),
// and the engine dates the call by it (sentAtOf).

// forceBetween holds a fake runner's hooks: the acquire's first command is
// answered without a grant, and its second waits until the test lets it go; a
// force-release's reply waits after it ran.
type forceBetween struct {
	firstSent   chan struct{} // closed when the first command was answered
	sendSecond  chan struct{} // the second command waits for this
	forceRan    chan struct{} // closed when a force-release ran on the server
	forceAnswer chan struct{} // its reply waits for this
}

func newForceBetween() forceBetween {
	return forceBetween{make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})}
}

// second waits for the test to let the second command go, and returns its send
// time.
func (fb forceBetween) second() time.Time {
	close(fb.firstSent)
	<-fb.sendSecond
	return time.Now()
}

// forced runs a force-release's hook once it ran.
func (fb forceBetween) forced(id scripts.ID) {
	if id == scripts.LockForceRelease {
		close(fb.forceRan)
		<-fb.forceAnswer
	}
}

// freshMem is batchMem with a lone lane and a FreshRunner that models
// Redis.RunLoneFresh: RESTORE (absent key: create {field: 1} with the lease),
// else BUSYKEY and the acquire script after it on the same connection.
type freshMem struct {
	*batchMem
	forceBetween
}

var _ scripts.FreshRunner = (*freshMem)(nil)

func (r *freshMem) RunLone(ctx context.Context, id scripts.ID, keys, args []string) (scripts.Reply, error) {
	return r.Run(ctx, id, keys, args)
}

func (r *freshMem) RunLoneFresh(ctx context.Context, keys, args []string) (scripts.Reply, error) {
	r.mu.Lock()
	if r.get(keys[0]) == nil {
		r.keys[keys[0]] = &memHash{fields: map[string]int64{args[1]: 1}}
		r.pexpire(keys[0], args[0])
		r.mu.Unlock()
		return scripts.Reply{Nil: true}, nil
	}
	r.mu.Unlock()
	scriptAt := r.second()
	reply, err := r.RunLone(ctx, scripts.LockAcquire, keys, args)
	reply.SentAt = scriptAt
	return reply, err
}

func (r *freshMem) Run(ctx context.Context, id scripts.ID, keys, args []string) (scripts.Reply, error) {
	reply, err := r.batchMem.Run(ctx, id, keys, args)
	r.forced(id)
	return reply, err
}

// noScriptMem is batchMem whose first acquire models Redis.Run: EVALSHA is
// answered NOSCRIPT (the server's script cache was flushed), and EVAL goes after
// it, later.
type noScriptMem struct {
	*batchMem
	forceBetween
	once sync.Once
}

func (r *noScriptMem) Run(ctx context.Context, id scripts.ID, keys, args []string) (scripts.Reply, error) {
	var evalAt time.Time
	if id == scripts.LockAcquire {
		first := false
		r.once.Do(func() { first = true })
		if first {
			evalAt = r.second()
		}
	}
	reply, err := r.batchMem.Run(ctx, id, keys, args)
	reply.SentAt = evalAt
	r.forced(id)
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

func TestFreshForceUnlockBetweenRestoreAndScript(t *testing.T) {
	r := &freshMem{batchMem: &batchMem{memRedis: newMemRedis()}, forceBetween: newForceBetween()}
	forceUnlockBetweenSends(t, r, r.batchMem, r.forceBetween, true)
}

func TestNoScriptRetryForceUnlockBetween(t *testing.T) {
	for _, held := range []bool{true, false} {
		t.Run(map[bool]string{true: "heldElsewhere", false: "free"}[held], func(t *testing.T) {
			r := &noScriptMem{batchMem: &batchMem{memRedis: newMemRedis()}, forceBetween: newForceBetween()}
			forceUnlockBetweenSends(t, r, r.batchMem, r.forceBetween, held)
		})
	}
}

// forceUnlockBetweenSends acquires "L" through runner (over mem, with hooks fb),
// held by another process if held; runs a ForceUnlock between the acquire's two
// sends; and checks that the hold stands, on Redis and here.
func forceUnlockBetweenSends(t *testing.T, runner scripts.Runner, mem *batchMem, fb forceBetween, held bool) {
	t.Helper()
	h := newEngine(t, runner)
	mem.publish = h.sub.deliver
	if held {
		mem.set("L", "other:1", 1, 10*time.Second)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	owner := h.e.NewOwner()
	acquired := make(chan error, 1)
	go func() { acquired <- h.e.AcquireWait(ctx, AcquireRequest{Lock: "L", Owner: owner, Wait: -1}) }()
	select {
	case <-fb.firstSent:
	case <-time.After(5 * time.Second):
		t.Fatal("the acquire's first command did not go")
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
	case <-fb.forceRan:
	case <-time.After(5 * time.Second):
		t.Fatal("the force-release did not run")
	}
	close(fb.sendSecond) // the second command goes now, after the force-release ran
	if err := recv(t, "acquire", acquired); err != nil {
		t.Fatalf("acquire: %v", err)
	}
	field := OwnerField(testClientID, owner)
	if got := mem.holders("L"); got[field] != 1 || len(got) != 1 {
		t.Fatalf("server has %v, want %s=1", got, field)
	}
	close(fb.forceAnswer)
	select {
	case f := <-forceDone:
		if f.err != nil || f.existed != held {
			t.Fatalf("ForceUnlock = %v, %v; want %v, nil", f.existed, f.err, held)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("ForceUnlock did not return")
	}
	// Settle: any check the force-release's reply started has been answered.
	if err := h.e.Settle(ctx, "L", owner); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the check's call answered", func() bool { return h.stats().Waiters == 0 })
	if got := mem.holders("L"); got[field] != 1 {
		t.Fatalf("server has %v, want %s=1 still", got, field)
	}
	select {
	case <-h.e.Lost("L", owner):
		err := h.e.Unlock(ctx, "L", owner)
		t.Fatalf("the hold was dropped as lost (Unlock: %v) while the server holds it for %s: %v", err, field, mem.holders("L"))
	default:
	}
	if err := h.e.Unlock(ctx, "L", owner); err != nil {
		t.Fatalf("unlock: %v", err)
	}
}
