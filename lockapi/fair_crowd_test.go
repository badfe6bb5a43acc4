package lockapi_test

import (
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// TestFairThousandWaitersFourProcesses: 1,000 waiters on one fair lock, 250 in
// each of 4 helper processes (a goroutine and a handle each), queued while the
// parent holds the lock, in whatever order the Redis queue ends up with. Once all
// are queued the parent snapshots the queue and releases. Each waiter, holding the
// lock, pushes the lock hash's only field (its own owner field) to a result list.
// Every waiter must be served in queue order, none out of turn, with at most 3
// script calls per handoff (1.5 is asserted: releases grant directly), and the
// waiters join the queue in batches.
func TestFairThousandWaitersFourProcesses(t *testing.T) {
	const (
		procs   = 4
		perProc = 250
		total   = procs * perProc
	)
	srv := testredis.New(t)
	name := fairName(t, "")
	result, queue := name+":result", fairQueueKey(name)

	c := newClient(t, srv, lockapi.Options{})
	holder := c.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	if err := srv.ResetStats(); err != nil {
		t.Fatal(err)
	}
	enqueueStart := time.Now()
	var ps []*fairProc
	for range procs {
		ps = append(ps, startFairHelper(t, "crowd",
			envFairAddr+"="+srv.Addr(), envFairLock+"="+name, envFairResult+"="+result,
			envFairCount+"="+strconv.Itoa(perProc)))
	}
	fairWaitLen(t, srv, queue, total, 40*time.Second)
	enqueueTime := time.Since(enqueueStart)
	order := fairList(t, srv, queue)
	if n := do(t, srv, "ZCARD", fairTimeoutKey(name)); n != strconv.Itoa(total) {
		t.Fatalf("ZCARD of the deadline set = %s, want %d", n, total)
	}
	if got := fairLen(t, srv, result); got != 0 {
		t.Fatalf("%d waiters got the lock while the parent held it", got)
	}

	pre, err := srv.CommandStats()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("queueing 1000 waiters: %d script calls, %d psubscribe, %d subscribe",
		pre["evalsha"]+pre["eval"], pre["psubscribe"], pre["subscribe"])
	// Waiters join the Redis queue in batches (one merged script call each), not
	// one call apiece.
	if calls := pre["evalsha"] + pre["eval"]; calls > total/4 {
		t.Errorf("queueing %d waiters took %d script calls, want batches (at most %d)", total, calls, total/4)
	}
	if err := srv.ResetStats(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	unlock(t, holder)
	fairWaitFor(t, 40*time.Second, "1000 acquisitions", func() bool { return fairLen(t, srv, result) >= total })
	elapsed := time.Since(start)
	for _, p := range ps {
		p.wait(t, 30*time.Second) // counted too: the last Unlocks, and each helper's Close
	}
	st, err := srv.CommandStats()
	if err != nil {
		t.Fatal(err)
	}

	got := fairList(t, srv, result)
	if !slices.Equal(got, order) {
		first := -1
		for i := range min(len(got), len(order)) {
			if got[i] != order[i] {
				first = i
				break
			}
		}
		t.Errorf("served out of queue order: %d results, %d queued; first difference at %d", len(got), len(order), first)
		if first >= 0 {
			t.Errorf("around it: got %q, queue had %q", got[first:min(first+3, len(got))], order[first:min(first+3, len(order))])
		}
	}

	scripts := st["evalsha"] + st["eval"]
	subs := st["subscribe"] + st["psubscribe"] + st["unsubscribe"] + st["punsubscribe"]
	perHandoff := float64(scripts) / total
	t.Logf("%d waiters, %d processes: queued in %v; served in %v (%.0f handoffs/s)",
		total, procs, enqueueTime.Round(time.Millisecond), elapsed.Round(time.Millisecond), total/elapsed.Seconds())
	t.Logf("after release: %d script calls (%.2f per handoff; evalsha %d, eval %d), %d publish, "+
		"%d (p)(un)subscribe requests (%.4f per handoff: subscribe %d, psubscribe %d, unsubscribe %d, punsubscribe %d)",
		scripts, perHandoff, st["evalsha"], st["eval"], st["publish"],
		subs, float64(subs)/total, st["subscribe"], st["psubscribe"], st["unsubscribe"], st["punsubscribe"])
	// The acceptance bound is 3. A release grants the next waiter directly, in any
	// process, so one call per handoff is what this design costs; 1.5 leaves room
	// for the odd claim (a grant racing an attempt).
	if perHandoff > 1.5 {
		t.Errorf("%.2f script calls per handoff, want at most 1.5 (direct grants; the acceptance bound is 3)", perHandoff)
	}
	if s, err := c.Stats(fairCtx(t, 5*time.Second)); err != nil || s.Waiters != 0 || s.Holds != 0 {
		t.Errorf("parent client stats after the run: %+v, %v", s, err)
	}
	fairMustBeClean(t, srv, name)
}
