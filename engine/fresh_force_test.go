package engine

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// freshMem is batchMem with a lone lane and a FreshRunner that models
// Redis.RunLoneFresh: RESTORE (absent key: create {field: 1} with the lease), else
// BUSYKEY and the acquire script after it on the same connection. Hooks let a
// test run other calls between the refused RESTORE and the script, and hold a
// force-release's reply after it ran.
type freshMem struct {
	*batchMem
	afterBusy   chan struct{} // closed when a RESTORE was refused (BUSYKEY)
	sendScript  chan struct{} // the script after BUSYKEY waits for this
	forceRan    chan struct{} // closed when a force-release ran on the server
	forceAnswer chan struct{} // its reply waits for this
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
	close(r.afterBusy)
	<-r.sendScript
	scriptAt := time.Now() // as Redis.RunLoneFresh reports the script's send
	reply, err := r.RunLone(ctx, scripts.LockAcquire, keys, args)
	reply.SentAt = scriptAt
	return reply, err
}

func (r *freshMem) Run(ctx context.Context, id scripts.ID, keys, args []string) (scripts.Reply, error) {
	reply, err := r.batchMem.Run(ctx, id, keys, args)
	if id == scripts.LockForceRelease {
		close(r.forceRan)
		<-r.forceAnswer
	}
	return reply, err
}

// TestFreshForceUnlockBetweenRestoreAndScript: a fresh attempt's RESTORE is refused
// (another process holds the lock); this client's ForceUnlock is sent and runs;
// then the acquire script is sent and takes the now free lock. The grant's call
// (the script) was sent after the force-release, and ran after it, so the
// force-release cannot have deleted it: the hold must stand (at most be checked).
// Dated at the RESTORE's send, before the force-release's, the grant would be
// dropped by the force-release's reply as its victim without a check: doLone
// dates it at the script's send (Reply.SentAt).
func TestFreshForceUnlockBetweenRestoreAndScript(t *testing.T) {
	r := &freshMem{
		batchMem:    &batchMem{memRedis: newMemRedis()},
		afterBusy:   make(chan struct{}),
		sendScript:  make(chan struct{}),
		forceRan:    make(chan struct{}),
		forceAnswer: make(chan struct{}),
	}
	h := newEngine(t, r)
	r.publish = h.sub.deliver
	r.set("L", "other:1", 1, 10*time.Second) // held by another process

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	owner := h.e.NewOwner()
	acquired := make(chan error, 1)
	go func() { acquired <- h.e.AcquireWait(ctx, AcquireRequest{Lock: "L", Owner: owner, Wait: -1}) }()
	select {
	case <-r.afterBusy:
	case <-time.After(5 * time.Second):
		t.Fatal("the first attempt did not go as a RESTORE refused with BUSYKEY")
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
	close(r.sendScript) // the script goes now, after the force-release ran
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
		if f.err != nil || !f.existed {
			t.Fatalf("ForceUnlock = %v, %v; want true, nil", f.existed, f.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("ForceUnlock did not return")
	}
	// Settle: any check the force-release's reply started has been answered.
	if err := h.e.Settle(ctx, "L", owner); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the check's call answered", func() bool { return h.stats().Waiters == 0 })
	if got := r.holders("L"); got[field] != 1 {
		t.Fatalf("server has %v, want %s=1 still", got, field)
	}
	lost := h.e.Lost("L", owner)
	select {
	case <-lost:
		err := h.e.Unlock(ctx, "L", owner)
		t.Fatalf("the hold was dropped as lost (Unlock: %v) while the server holds it for %s: %v", err, field, r.holders("L"))
	default:
	}
	if err := h.e.Unlock(ctx, "L", owner); err != nil && !errors.Is(err, ErrNotHeld) {
		t.Fatalf("unlock: %v", err)
	} else if err != nil {
		t.Fatalf("unlock: %v", err)
	}
}
