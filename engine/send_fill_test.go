package engine

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// waitForFill's rule, case by case: calls only their callers wait for hold back
// from a free slot while they are under a maxSends-th of the calls outstanding;
// nothing holds back when no send is in flight, an urgent call is pending, or
// Close is under way.
func TestWaitForFillRule(t *testing.T) {
	cases := []struct {
		name            string
		sends, fillable int
		pending, urgent int
		closing         bool
		wait            bool
	}{
		{name: "nothing in flight", sends: 0, fillable: 0, pending: 1},
		{name: "nothing in flight, many pending", sends: 0, fillable: 0, pending: 3},
		{name: "few in flight", sends: 1, fillable: 1, pending: 1},
		{name: "a quarter of outstanding", sends: 3, fillable: 60, pending: 20},
		{name: "under a quarter", sends: 3, fillable: 60, pending: 19, wait: true},
		{name: "one behind a full send", sends: 1, fillable: 64, pending: 1, wait: true},
		{name: "an urgent call pending", sends: 1, fillable: 64, pending: 2, urgent: 1},
		{name: "closing", sends: 1, fillable: 64, pending: 1, closing: true},
		{name: "only other calls in flight", sends: 1, fillable: 0, pending: 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := &Engine{m: &machine{closing: c.closing}, sends: c.sends, fillable: c.fillable,
				pending: make([]scriptCall, c.pending), pendingUrgent: c.urgent}
			if got := e.waitForFill(); got != c.wait {
				t.Errorf("waitForFill() = %v, want %v", got, c.wait)
			}
		})
	}
}

// Only fresh attempts and quiet releases not sent before may wait; every other
// call is urgent.
func TestMayWaitForFill(t *testing.T) {
	for _, c := range []struct {
		call scriptCall
		want bool
	}{
		{scriptCall{purpose: purposeAttempt, fresh: true}, true},
		{scriptCall{purpose: purposeUnlock, quiet: true}, true},
		{scriptCall{purpose: purposeUnlock, quiet: true, retried: true}, false},
		{scriptCall{purpose: purposeAttempt}, false},
		{scriptCall{purpose: purposeUnlock}, false},
		{scriptCall{script: scripts.LockHandoff}, false},
	} {
		if got := mayWaitForFill(&c.call); got != c.want {
			t.Errorf("mayWaitForFill(%+v) = %v, want %v", c.call, got, c.want)
		}
	}
}

// gatedBatch is batchMem whose batches each wait for the test to let them run,
// so the test decides which sends are in flight.
type gatedBatch struct {
	*batchMem
	mu      sync.Mutex
	started []int           // each batch's number of calls, in the order they arrived
	gates   []chan struct{} // closed to let batch i run
	arrived chan struct{}   // one value per batch arriving
	opened  []bool
	all     bool // every gate is open, now and later
}

func (g *gatedBatch) RunBatch(ctx context.Context, calls []scripts.Call, out []scripts.Result) []scripts.Result {
	g.wait(len(calls))
	return g.batchMem.RunBatch(ctx, calls, out)
}

// Run is a send of one call (the engine sends a batch of one with Run).
func (g *gatedBatch) Run(ctx context.Context, id scripts.ID, keys, args []string) (scripts.Reply, error) {
	g.wait(1)
	return g.memRedis.Run(ctx, id, keys, args)
}

func (g *gatedBatch) wait(calls int) {
	gate := make(chan struct{})
	g.mu.Lock()
	g.started = append(g.started, calls)
	g.gates = append(g.gates, gate)
	g.opened = append(g.opened, false)
	all := g.all
	g.mu.Unlock()
	if all {
		return
	}
	g.arrived <- struct{}{}
	<-gate
}

func (g *gatedBatch) open(i int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.opened[i] {
		g.opened[i] = true
		close(g.gates[i])
	}
}

// openAll lets every batch run, now and later (so a failed test's Close ends).
func (g *gatedBatch) openAll() {
	g.mu.Lock()
	g.all = true
	n := len(g.gates)
	g.mu.Unlock()
	for i := range n {
		g.open(i)
	}
}

func (g *gatedBatch) sizes() []int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]int(nil), g.started...)
}

// Against the engine: with a full send in flight, a fresh attempt on a free lock
// does not take a free slot alone; an urgent call (a release that is not quiet:
// no earlier release of the lock found nobody listening) takes one at once, and
// the waiting attempt goes with it; and nothing stalls.
func TestEngineFreshAttemptWaitsForFill(t *testing.T) {
	g := &gatedBatch{batchMem: &batchMem{memRedis: newMemRedis()}, arrived: make(chan struct{}, 64)}
	h := newEngine(t, g)
	t.Cleanup(g.openAll) // before the engine's Close (cleanups run last first)
	g.publish = h.sub.deliver
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	await := func(what string) {
		t.Helper()
		select {
		case <-g.arrived:
		case <-ctx.Done():
			t.Fatalf("%s: no batch arrived (sizes so far %v)", what, g.sizes())
		}
	}
	acquire := func(lock string, owner uint64) <-chan error {
		return h.e.Acquire(ctx, AcquireRequest{Lock: lock, Owner: owner, Wait: -1})
	}

	// Four single sends fill the slots; then 20 more attempts pend, and go
	// together when the first send comes back (its sender takes them).
	var first []<-chan error
	owner0 := h.e.NewOwner()
	for i := range maxSends {
		owner := owner0
		if i > 0 {
			owner = h.e.NewOwner()
		}
		first = append(first, acquire(fmt.Sprintf("fill-a%d", i), owner))
		await(fmt.Sprintf("slot %d", i))
	}
	var batch []<-chan error
	for i := range 20 {
		batch = append(batch, acquire(fmt.Sprintf("fill-b%d", i), h.e.NewOwner()))
	}
	eventually(t, "the 20 attempts pending", func() bool { // Acquire returns before the engine has them
		h.e.mu.Lock()
		defer h.e.mu.Unlock()
		return len(h.e.pending) == 20
	})
	g.open(0)
	await("the 20 pending attempts")
	if got := g.sizes(); got[maxSends] != 20 {
		t.Fatalf("batch sizes %v: want the 20 pending attempts in one", got)
	}
	// The send that came back took the 20 along: the slots are full again. One
	// more single comes back, and its sender finds nothing pending.
	g.open(1)
	for _, ch := range first[:2] {
		if err := <-ch; err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "three sends in flight", func() bool {
		h.e.mu.Lock()
		defer h.e.mu.Unlock()
		return h.e.sends == 3 && h.e.inflight == 22 && h.e.fillable == 22
	})

	// Three sends in flight, 22 calls: one fresh attempt waits for them.
	late := acquire("fill-late", h.e.NewOwner())
	eventually(t, "the late attempt pending", func() bool {
		h.e.mu.Lock()
		defer h.e.mu.Unlock()
		return len(h.e.pending) == 1
	})
	select {
	case <-g.arrived:
		t.Fatalf("a fresh attempt took a slot alone behind 22 calls in flight (sizes %v)", g.sizes())
	default:
	}
	unlocked := make(chan error, 1)
	go func() { unlocked <- h.e.Unlock(ctx, "fill-a0", owner0) }()
	await("the release")
	if got := g.sizes(); got[len(got)-1] != 2 {
		t.Fatalf("batch sizes %v: want the release sent at once with the waiting attempt", got)
	}
	g.openAll()
	for _, ch := range append(append(first[2:], batch...), late, unlocked) {
		if err := <-ch; err != nil {
			t.Fatal(err)
		}
	}
}
