package scripts_test

// Tests of the fair-lock scripts. Their clock is ARGV "now", which the tests
// choose: t0 plus an offset. Deadlines are written and read relative to t0,
// so a queue is described as "B:+25000 C:+30000" (list order, deadline - t0).
// Only the lock's PTTL is real time.

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/leash-go/leash/internal/scripts"
)

const (
	t0   = 1_700_000_000_000 // ms since the epoch: the tests' "now" is t0 + an offset
	wait = 5_000             // ms: the fair wait allowance
)

// fair names one fair lock's keys and channels.
type fair struct{ name, queue, timeout, prefix, grants string }

func fairLock(name string) fair {
	return fair{
		name:    name,
		queue:   "redisson_lock_queue:{" + name + "}",
		timeout: "redisson_lock_timeout:{" + name + "}",
		prefix:  channel(name),
		grants:  "leash_lock_grants:{" + name + "}",
	}
}

// acquireKeys are fair_acquire's keys; keys are the other fair scripts'.
func (f fair) acquireKeys() []string { return []string{f.name, f.queue, f.timeout, f.grants} }
func (f fair) keys() []string        { return []string{f.name, f.queue, f.timeout, f.prefix, f.grants} }

// wake is what a script publishes to wake owner; "B=leash:grant:7" names the
// message too (a direct grant to B's waiter 7).
func (f fair) wake(owner string) string {
	if strings.Contains(owner, "=") {
		return f.prefix + ":" + owner
	}
	return f.prefix + ":" + owner + "=0"
}

func at(offset int64) string { return strconv.FormatInt(t0+offset, 10) }

// setQueue writes a queue described as "B:+25000 C:+30000"; "B:none" is a list entry
// without a deadline, "~B:+25000" a deadline without a list entry (torn queues).
func (e *env) setQueue(t *testing.T, f fair, spec string) {
	t.Helper()
	e.do(t, "DEL", f.queue, f.timeout)
	for entry := range strings.FieldsSeq(spec) {
		owner, dl, _ := strings.Cut(entry, ":")
		setOnly := strings.HasPrefix(owner, "~")
		owner = strings.TrimPrefix(owner, "~")
		if !setOnly {
			e.do(t, "RPUSH", f.queue, owner)
		}
		if dl != "none" {
			off, err := strconv.ParseInt(dl, 10, 64)
			if err != nil {
				t.Fatalf("queue spec %q: %v", entry, err)
			}
			e.do(t, "ZADD", f.timeout, at(off), owner)
		}
	}
}

// queueState describes the queue as setQueue writes it.
func (e *env) queueState(t *testing.T, f fair) string {
	t.Helper()
	var parts []string
	listed := map[string]bool{}
	deadline := func(owner string) string {
		s := e.do(t, "ZSCORE", f.timeout, owner)
		if s == "" {
			return "none"
		}
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			t.Fatalf("ZSCORE %s %s = %q", f.timeout, owner, s)
		}
		return fmt.Sprintf("%+d", int64(v)-t0)
	}
	if list := e.do(t, "LRANGE", f.queue, "0", "-1"); list != "" {
		for _, owner := range strings.Split(list, "\n") {
			listed[owner] = true
			parts = append(parts, owner+":"+deadline(owner))
		}
	}
	if set := e.do(t, "ZRANGE", f.timeout, "0", "-1"); set != "" {
		for _, owner := range strings.Split(set, "\n") {
			if !listed[owner] {
				parts = append(parts, "~"+owner+":"+deadline(owner))
			}
		}
	}
	return strings.Join(parts, " ")
}

func (e *env) wantQueue(t *testing.T, f fair, want string) {
	t.Helper()
	if got := e.queueState(t, f); got != want {
		t.Errorf("queue = %q, want %q", got, want)
	}
}

func (e *env) fairAcquire(t *testing.T, f fair, owner string, offset int64, single bool) scripts.Reply {
	t.Helper()
	s := "0"
	if single {
		s = "1"
	}
	return e.run(t, scripts.FairAcquire, f.acquireKeys(), strconv.Itoa(lease), owner, strconv.Itoa(wait), at(offset), s)
}

// fairAcquireCase runs fair_acquire with all of a case's arguments.
func (e *env) fairAcquireCase(t *testing.T, f fair, c fairCase) scripts.Reply {
	t.Helper()
	return e.run(t, scripts.FairAcquire, f.acquireKeys(), c.acquireArgs()...)
}

// acquireArgs are fair_acquire's arguments for the case.
func (c fairCase) acquireArgs() []string {
	single, claim := "0", "0"
	if c.single {
		single = "1"
	}
	if c.joinOnly {
		single = "2"
	}
	if c.claim {
		claim = "1"
	}
	return []string{strconv.Itoa(lease), c.owner, strconv.Itoa(wait), at(c.at), single, c.register, claim}
}

// fairCase is the shape shared by the fair scripts' table tests.
type fairCase struct {
	name     string
	hash     string // the lock's hash before the call ("" = free)
	pttl     int64  // its PTTL in ms (0: 20000; -1: no expiry)
	queue    string // the queue before the call (see setQueue)
	owner    string
	at       int64  // now - t0
	single   bool   // fair_acquire's ARGV[5] "1"
	joinOnly bool   // fair_acquire's ARGV[5] "2"
	grants   string // the direct-grants hash before the call, as "B=45000:7"
	// fair_acquire's ARGV[6] and ARGV[7]: the registration for a direct grant, and a
	// claim of an unheard one.
	register string
	claim    bool
	keep     string // fair_release's ARGV[6], the count the caller expects to keep ("": absent)

	wantGrants string // the direct-grants hash after the call

	want      string // the reply: "nil", an integer, or "pttl" (an integer ≈ the lock's PTTL)
	wantHash  string
	wantQueue string // may hold one %d, replaced by the reply + wait + at (a new waiter's deadline - t0)
	wantLease int64  // when non-zero, the lock's PTTL was just set to it
	wantWake  []string
}

const defaultPTTL = 20_000

// setup writes the case's state for lock f and starts watching its channels.
func (c fairCase) setup(t *testing.T, e *env, f fair) *watcher {
	t.Helper()
	pttl := c.pttl
	if pttl == 0 {
		pttl = defaultPTTL
	}
	e.setHash(t, f.name, c.hash, pttl)
	e.setQueue(t, f, c.queue)
	e.setHash(t, f.grants, c.grants, -1)
	return e.watch(t, f.name)
}

// check compares the reply and the state after the call with the case's wants.
func (c fairCase) check(t *testing.T, e *env, f fair, w *watcher, what string, rep scripts.Reply) {
	t.Helper()
	wantQueue := c.wantQueue
	if c.want == "pttl" {
		pttl := c.pttl
		if pttl == 0 {
			pttl = defaultPTTL
		}
		lo, hi := pttl-pttlSlack, pttl
		if pttl < 0 {
			lo, hi = pttl-1, pttl
		}
		wantIntIn(t, what, rep, lo, hi)
	} else {
		wantReply(t, what, rep, c.want)
	}
	if strings.Contains(wantQueue, "%d") {
		wantQueue = fmt.Sprintf(wantQueue, rep.Int+wait+c.at)
	}
	e.wantQueue(t, f, wantQueue)
	e.wantHash(t, f.name, c.wantHash)
	e.wantHash(t, f.grants, c.wantGrants)
	if c.wantLease != 0 {
		e.wantPTTL(t, f.name, c.wantLease)
	}
	var wakes []string
	for _, o := range c.wantWake {
		wakes = append(wakes, f.wake(o))
	}
	w.want(t, wakes...)
}

// ---- fair_acquire ----

// fairAcquireCases are fair_acquire's cases, shared with RunLoneFreshFair's test.
var fairAcquireCases = []fairCase{
	{name: "free, empty queue", owner: "A", want: "nil", wantHash: "A=1", wantLease: lease},
	{name: "reentry", hash: "A=1", pttl: 1_000, owner: "A", want: "nil", wantHash: "A=2", wantLease: lease},
	{name: "reentry with others queued", hash: "A=1", queue: "B:+25000", owner: "A",
		want: "nil", wantHash: "A=2", wantQueue: "B:+25000", wantLease: lease},

	// queueing
	{name: "held: first waiter waits the PTTL", hash: "A=1", owner: "B",
		want: "pttl", wantHash: "A=1", wantQueue: "B:+%d"},
	{name: "held, no expiry: first waiter", hash: "A=1", pttl: -1, owner: "B",
		want: "-1", wantHash: "A=1", wantQueue: "B:+4999"},
	{name: "second waiter waits until the first could go stale", hash: "A=1", queue: "B:+25000", owner: "C", at: 100,
		want: "24900", wantHash: "A=1", wantQueue: "B:+25000 C:+30000"},
	{name: "third waiter", hash: "A=1", queue: "B:+25000 C:+30000", owner: "D", at: 100,
		want: "29900", wantHash: "A=1", wantQueue: "B:+25000 C:+30000 D:+35000"},
	{name: "free lock with a live head: queue behind it", queue: "X:+25000", owner: "B",
		want: "25000", wantQueue: "X:+25000 B:+30000"},

	// asking again
	{name: "head asks again, deadline kept", hash: "A=1", queue: "B:+25000 C:+30000", owner: "B", at: 100,
		want: "pttl", wantHash: "A=1", wantQueue: "B:+25000 C:+30000"},
	{name: "head asks again, deadline refreshed", hash: "A=1", queue: "B:+3000 C:+30000", owner: "B", at: 1_000,
		want: "pttl", wantHash: "A=1", wantQueue: "B:+6000 C:+30000"},
	{name: "head asks again, no expiry", hash: "A=1", pttl: -1, queue: "B:+25000", owner: "B",
		want: "-1", wantHash: "A=1", wantQueue: "B:+25000"},
	{name: "second asks again, deadline kept", hash: "A=1", queue: "B:+25000 C:+30000", owner: "C", at: 1_000,
		want: "24000", wantHash: "A=1", wantQueue: "B:+25000 C:+30000"},
	{name: "second asks again, deadline refreshed", hash: "A=1", queue: "B:+25000 C:+2000", owner: "C", at: 1_000,
		want: "24000", wantHash: "A=1", wantQueue: "B:+25000 C:+6000"},
	{name: "third asks again: the one just ahead counts", hash: "A=1", queue: "B:+25000 C:+30000 D:+35000",
		owner: "D", at: 1_000, want: "29000", wantHash: "A=1", wantQueue: "B:+25000 C:+30000 D:+35000"},
	{name: "free lock, second asks again behind a live head", queue: "B:+25000 C:+30000", owner: "C", at: 1_000,
		want: "24000", wantQueue: "B:+25000 C:+30000"},

	// purging stale heads
	{name: "stale head purged, next acquires", queue: "B:+1000 C:+30000", owner: "C", at: 1_000,
		want: "nil", wantHash: "C=1", wantLease: lease},
	{name: "head one ms before its deadline is not purged", queue: "B:+1001 C:+30000", owner: "C", at: 1_000,
		want: "1", wantQueue: "B:+1001 C:+30000"},
	{name: "stale heads purged in a row", queue: "B:+500 C:+1000 D:+30000 E:+35000", owner: "D", at: 1_000,
		want: "nil", wantHash: "D=1", wantQueue: "E:+6000", wantLease: lease}, // E heads now: at most now + allowance
	{name: "stale head purged while held: newcomer waits the PTTL", hash: "A=1", queue: "B:+1000", owner: "C",
		at: 1_000, want: "pttl", wantHash: "A=1", wantQueue: "C:+%d"},
	{name: "only heads are purged", hash: "A=1", queue: "B:+25000 C:+500", owner: "A", at: 1_000,
		want: "nil", wantHash: "A=2", wantQueue: "B:+25000 C:+500", wantLease: lease},
	{name: "head without a deadline counts as stale", queue: "B:none C:+30000", owner: "C",
		want: "nil", wantHash: "C=1", wantLease: lease},

	// single try
	{name: "single try, free", owner: "B", single: true, want: "nil", wantHash: "B=1", wantLease: lease},
	{name: "single try, held: never queues", hash: "A=1", owner: "B", single: true,
		want: "1", wantHash: "A=1"},
	{name: "single try, free lock with a live head", queue: "X:+25000", owner: "B", single: true,
		want: "1", wantQueue: "X:+25000"},
	{name: "single try, reentry", hash: "B=1", owner: "B", single: true, want: "nil", wantHash: "B=2", wantLease: lease},
	{name: "single try by the head of a free lock", queue: "B:+25000 C:+30000", owner: "B", single: true,
		want: "nil", wantHash: "B=1", wantQueue: "C:+5000", wantLease: lease},

	// join only
	{name: "join only, free lock, empty queue: queued, not taken", owner: "B", joinOnly: true,
		want: "-2", wantQueue: "B:+4998"}, // the deadline is PTTL (-2) + allowance
	{name: "join only, held: queued as usual", hash: "A=1", owner: "B", joinOnly: true,
		want: "pttl", wantHash: "A=1", wantQueue: "B:+%d"},
	{name: "join only, reentry still re-enters", hash: "B=1", owner: "B", joinOnly: true,
		want: "nil", wantHash: "B=2", wantLease: lease},

	// moving up on acquisition
	// O(1) per grant: only the new head's deadline comes down, to at most now +
	// allowance; the deadlines behind it stay (Redisson lowers them all).
	{name: "acquisition caps only the new head's deadline", queue: "B:+20000 C:+25000 D:+40000", owner: "B",
		want: "nil", wantHash: "B=1", wantQueue: "C:+5000 D:+40000", wantLease: lease},
	{name: "a new head's deadline is never raised", queue: "B:+20000 C:+3000 D:+9000 E:+30000",
		owner: "B", at: 1_000, want: "nil", wantHash: "B=1", wantQueue: "C:+3000 D:+9000 E:+30000", wantLease: lease},
	{name: "acquisition without a queue touches no deadline", owner: "B", queue: "~Z:+90000",
		want: "nil", wantHash: "B=1", wantQueue: "~Z:+90000", wantLease: lease},

	// direct grants
	{name: "queueing registers for a direct grant", hash: "A=1", owner: "B", register: "45000:7",
		want: "pttl", wantHash: "A=1", wantQueue: "B:+%d", wantGrants: "B=45000:7"},
	{name: "asking again re-registers", hash: "A=1", queue: "B:+25000", grants: "B=45000:7", owner: "B",
		register: "45000:9", want: "pttl", wantHash: "A=1", wantQueue: "B:+25000", wantGrants: "B=45000:9"},
	{name: "asking again without registering drops the registration", hash: "A=1", queue: "B:+25000",
		grants: "B=45000:7", owner: "B", want: "pttl", wantHash: "A=1", wantQueue: "B:+25000"},
	{name: "a single try never registers", hash: "A=1", owner: "B", single: true, register: "45000:7",
		want: "1", wantHash: "A=1"},
	{name: "claim: an unheard direct grant is taken as it is", hash: "B=1", pttl: 1_000, owner: "B", claim: true,
		want: "nil", wantHash: "B=1", wantLease: lease},
	{name: "the head taking the lock drops its registration", queue: "B:+25000 C:+30000",
		grants: "B=45000:7 C=45000:8", owner: "B", want: "nil", wantHash: "B=1", wantQueue: "C:+5000",
		wantGrants: "C=45000:8", wantLease: lease},
	{name: "a purged head loses its registration", queue: "B:+1000 C:+30000", grants: "B=45000:7",
		owner: "C", at: 1_000, want: "nil", wantHash: "C=1", wantLease: lease},
}

func TestFairAcquire(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for i, tc := range fairAcquireCases {
		t.Run(tc.name, func(t *testing.T) {
			f := fairLock(fmt.Sprintf("fa%d", i))
			w := tc.setup(t, e, f)
			rep := e.fairAcquireCase(t, f, tc)
			tc.check(t, e, f, w, "fair_acquire", rep)
		})
	}
}

// TestFairSequence runs the fair scripts one after the other, as three clients
// would: the queue is built by fair_acquire alone.
func TestFairSequence(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	f := fairLock("seq")
	w := e.watch(t, f.name)
	score := func(owner string) int64 {
		t.Helper()
		v, err := strconv.ParseFloat(e.do(t, "ZSCORE", f.timeout, owner), 64)
		if err != nil {
			t.Fatalf("no deadline for %s", owner)
		}
		return int64(v) - t0
	}

	wantReply(t, "A acquires", e.fairAcquire(t, f, "A", 0, false), "nil")
	ttlB := wantIntIn(t, "B queues", e.fairAcquire(t, f, "B", 0, false), lease-pttlSlack, lease)
	if got := score("B"); got != ttlB+wait {
		t.Errorf("B's deadline = +%d, want its reply + wait = +%d", got, ttlB+wait)
	}
	// C's wait is B's deadline - now, exactly; its deadline one allowance after B's.
	wantReply(t, "C queues", e.fairAcquire(t, f, "C", 10, false), strconv.FormatInt(ttlB+wait-10, 10))
	wantReply(t, "D queues", e.fairAcquire(t, f, "D", 20, false), strconv.FormatInt(ttlB+2*wait-20, 10))
	e.wantQueue(t, f, fmt.Sprintf("B:%+d C:%+d D:%+d", ttlB+wait, ttlB+2*wait, ttlB+3*wait))
	w.want(t)

	// A's release wakes B only.
	wantReply(t, "A releases", e.run(t, scripts.FairRelease, f.keys(), unlockMsg, strconv.Itoa(lease), "A", at(30), strconv.Itoa(wait)), "1")
	w.want(t, f.wake("B"))
	// C, woken by nobody, tries: the lock is free but B heads the queue.
	wantReply(t, "C tries", e.fairAcquire(t, f, "C", 40, false), strconv.FormatInt(ttlB+wait-40, 10))
	wantReply(t, "B acquires", e.fairAcquire(t, f, "B", 50, false), "nil")
	// C heads the queue now: its deadline comes down to now + allowance; D's stays.
	e.wantQueue(t, f, fmt.Sprintf("C:%+d D:%+d", 50+wait, ttlB+3*wait))

	// C gives up; D moves up one allowance and, with the lock held, nobody is woken.
	wantReply(t, "C leaves", e.run(t, scripts.FairLeave, f.keys(), "C", strconv.Itoa(wait), unlockMsg, at(60), "1"), "1")
	e.wantQueue(t, f, fmt.Sprintf("D:%+d", ttlB+2*wait))
	w.want(t)

	// B hands the lock to D, the head.
	wantReply(t, "B hands off to D", e.run(t, scripts.FairHandoff, f.keys(),
		"B", strconv.Itoa(lease), "D", strconv.Itoa(leaseB), strconv.Itoa(wait), at(70), unlockMsg), "2")
	e.wantHash(t, f.name, "D=1")
	e.wantPTTL(t, f.name, leaseB)
	e.wantQueue(t, f, "")

	// D vanishes: its hold is dropped for it; nobody is queued, nothing published.
	wantReply(t, "D abandoned", e.run(t, scripts.LockReleaseOwner, []string{f.name, f.prefix, f.queue},
		unlockMsg, "D", "0"), "1")
	w.want(t)
	for _, k := range []string{f.name, f.queue, f.timeout} {
		if n := e.doInt(t, "EXISTS", k); n != 0 {
			t.Errorf("%s left behind", k)
		}
	}
}

// ---- fair_release ----

func TestFairRelease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cases := []fairCase{
		{name: "full release wakes only the head", hash: "A=1", queue: "B:+25000 C:+30000", owner: "A",
			want: "1", wantQueue: "B:+25000 C:+30000", wantWake: []string{"B"}},
		{name: "full release, empty queue", hash: "A=1", owner: "A", want: "2"},
		{name: "count 2", hash: "A=2", pttl: 1_000, queue: "B:+25000", owner: "A",
			want: "0", wantHash: "A=1", wantQueue: "B:+25000", wantLease: lease},
		{name: "count 2, keeping 1", hash: "A=2", pttl: 1_000, queue: "B:+25000", owner: "A", keep: "1",
			want: "0", wantHash: "A=1", wantQueue: "B:+25000", wantLease: lease},
		// A retry of that release, whose first try ran: nothing more goes.
		{name: "count 1, keeping 1", hash: "A=1", pttl: 1_000, queue: "B:+25000", owner: "A", keep: "1",
			want: "0", wantHash: "A=1", wantQueue: "B:+25000", wantLease: lease},
		{name: "not held, lock free: the head is still woken", queue: "B:+25000 C:+30000", owner: "A",
			want: "nil", wantQueue: "B:+25000 C:+30000", wantWake: []string{"B"}},
		{name: "not held, lock free, empty queue", owner: "A", want: "nil"},
		{name: "not held, lock held by another", hash: "X=1", queue: "B:+25000", owner: "A",
			want: "nil", wantHash: "X=1", wantQueue: "B:+25000"},
		{name: "stale head purged, the next is woken", hash: "A=1", queue: "B:+500 C:+30000", owner: "A", at: 1_000,
			want: "1", wantQueue: "C:+30000", wantWake: []string{"C"}},
		{name: "all heads stale: nobody woken", hash: "A=1", queue: "B:+500 C:+1000", owner: "A", at: 1_000,
			want: "2"},

		// direct grants
		{name: "a registered head gets the lock directly", hash: "A=1", queue: "B:+25000 C:+30000",
			grants: "B=45000:7 C=45000:8", owner: "A", want: "1", wantHash: "B=1", wantLease: leaseB,
			wantQueue: "C:+5000", wantGrants: "C=45000:8", wantWake: []string{"B=leash:grant:7"}},
		{name: "a numbered registration's grant names its number", hash: "A=1", queue: "B:+25000 C:+30000",
			grants: "B=45000:7.3 C=45000:8.1", owner: "A", want: "1", wantHash: "B=1", wantLease: leaseB,
			wantQueue: "C:+5000", wantGrants: "C=45000:8.1", wantWake: []string{"B=leash:grant:7.3"}},
		{name: "a registration with two numbering dots is malformed: woken", hash: "A=1", queue: "B:+25000",
			grants: "B=45000:7.3.1", owner: "A", want: "1", wantQueue: "B:+25000", wantGrants: "B=45000:7.3.1",
			wantWake: []string{"B"}},
		{name: "an unregistered head (a Redisson client) is woken", hash: "A=1", queue: "B:+25000 C:+30000",
			grants: "C=45000:8", owner: "A", want: "1", wantQueue: "B:+25000 C:+30000", wantGrants: "C=45000:8",
			wantWake: []string{"B"}},
		{name: "a malformed registration is woken", hash: "A=1", queue: "B:+25000", grants: "B=junk", owner: "A",
			want: "1", wantQueue: "B:+25000", wantGrants: "B=junk", wantWake: []string{"B"}},
		{name: "not held, lock free: a registered head gets it", queue: "B:+25000", grants: "B=45000:7", owner: "A",
			want: "nil", wantHash: "B=1", wantLease: leaseB, wantWake: []string{"B=leash:grant:7"}},
		{name: "a purged head's registration goes, the next gets the lock", hash: "A=1", queue: "B:+500 C:+30000",
			grants: "B=45000:7 C=45000:8", owner: "A", at: 1_000, want: "1", wantHash: "C=1", wantLease: leaseB,
			wantWake: []string{"C=leash:grant:8"}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := fairLock(fmt.Sprintf("fr%d", i))
			w := tc.setup(t, e, f)
			args := []string{unlockMsg, strconv.Itoa(lease), tc.owner, at(tc.at), strconv.Itoa(wait)}
			if tc.keep != "" {
				args = append(args, tc.keep)
			}
			rep := e.run(t, scripts.FairRelease, f.keys(), args...)
			tc.check(t, e, f, w, "fair_release", rep)
		})
	}
}

// ---- fair_leave ----

func TestFairLeave(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const q = "B:+20000 C:+25000 D:+30000"
	cases := []fairCase{
		{name: "head leaves a free lock: the new head is woken", queue: q, owner: "B",
			want: "1", wantQueue: "C:+20000 D:+25000", wantWake: []string{"C"}},
		{name: "head leaves a held lock: nobody woken", hash: "A=1", queue: q, owner: "B",
			want: "1", wantHash: "A=1", wantQueue: "C:+20000 D:+25000"},
		{name: "middle leaves", queue: q, owner: "C", want: "1", wantQueue: "B:+20000 D:+25000"},
		{name: "tail leaves", queue: q, owner: "D", want: "1", wantQueue: "B:+20000 C:+25000"},
		{name: "moving up never goes below now + allowance", queue: "B:+20000 C:+7000 D:+9000 E:+30000", owner: "B",
			at: 1_000, want: "1", wantQueue: "C:+6000 D:+6000 E:+25000", wantWake: []string{"C"}},
		{name: "only waiter leaves", queue: "B:+20000", owner: "B", want: "1"},
		{name: "not queued", queue: q, owner: "X", want: "0", wantQueue: q},
		{name: "not queued, empty queue", owner: "X", want: "0"},
		{name: "deadline without a list entry is removed", queue: "B:+20000 ~X:+25000", owner: "X",
			want: "0", wantQueue: "B:+20000"},

		// direct grants
		{name: "the leaver's registration goes", queue: q, grants: "B=45000:7", owner: "B",
			want: "1", wantQueue: "C:+20000 D:+25000", wantWake: []string{"C"}},
		{name: "head leaves a free lock: a registered new head gets it", queue: q, grants: "C=45000:8", owner: "B",
			want: "1", wantHash: "C=1", wantLease: leaseB, wantQueue: "D:+5000", wantWake: []string{"C=leash:grant:8"}},
		{name: "an unheard direct grant is given back and passed on", hash: "B=1", queue: "C:+25000 D:+30000",
			grants: "C=45000:8", owner: "B", want: "2", wantHash: "C=1", wantLease: leaseB, wantQueue: "D:+5000",
			wantWake: []string{"C=leash:grant:8"}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := fairLock(fmt.Sprintf("fl%d", i))
			w := tc.setup(t, e, f)
			rep := e.run(t, scripts.FairLeave, f.keys(), tc.owner, strconv.Itoa(wait), unlockMsg, at(tc.at), "1")
			tc.check(t, e, f, w, "fair_leave", rep)
		})
	}
}

// ---- fair_handoff ----

func TestFairHandoff(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// A releases; R is the local waiter it would hand the lock to.
	cases := []fairCase{
		{name: "receiver heads the queue", hash: "A=1", queue: "R:+20000 X:+25000", owner: "A",
			want: "2", wantHash: "R=1", wantQueue: "X:+5000", wantLease: leaseB},
		{name: "receiver heads the queue, floor on moving up", hash: "A=1", queue: "R:+20000 X:+7000", owner: "A",
			at: 1_000, want: "2", wantHash: "R=1", wantQueue: "X:+6000", wantLease: leaseB},
		{name: "someone else heads the queue: released, head woken", hash: "A=1", queue: "X:+20000 R:+25000", owner: "A",
			want: "1", wantQueue: "X:+20000 R:+25000", wantWake: []string{"X"}},
		{name: "stale head purged: the receiver is next", hash: "A=1", queue: "S:+500 R:+20000", owner: "A", at: 1_000,
			want: "2", wantHash: "R=1", wantLease: leaseB},
		{name: "receiver not queued, empty queue: released", hash: "A=1", owner: "A", want: "1"},
		{name: "still held", hash: "A=2", pttl: 1_000, queue: "R:+20000", owner: "A",
			want: "0", wantHash: "A=1", wantQueue: "R:+20000", wantLease: lease},
		{name: "not held", hash: "X=1", queue: "R:+20000", owner: "A",
			want: "nil", wantHash: "X=1", wantQueue: "R:+20000"},
		{name: "a registered head other than the receiver gets the lock directly", hash: "A=1",
			queue: "X:+20000 R:+25000", grants: "X=45000:9", owner: "A", want: "1", wantHash: "X=1",
			wantLease: leaseB, wantQueue: "R:+5000", wantWake: []string{"X=leash:grant:9"}},
		{name: "the receiver's registration goes with the handoff", hash: "A=1", queue: "R:+20000",
			grants: "R=45000:3", owner: "A", want: "2", wantHash: "R=1", wantLease: leaseB},
	}
	// An early grant (ARGV[8] = "1") and the caller's next queued waiter (ARGV[9]).
	// A follow-up of a relay (ARGV[11..]): relayed fields leave the queue first;
	// the run after ARGV[9] tells how much of the queue's front the caller knows.
	type earlyCase struct {
		fairCase
		early, retry bool
		next         string
		relayed, run []string
	}
	earlyCases := []earlyCase{
		{fairCase: fairCase{name: "the next waiter heads the queue now: 3", hash: "A=1", queue: "R:+20000 N:+25000",
			owner: "A", want: "3", wantHash: "R=1", wantQueue: "N:+5000", wantLease: leaseB}, next: "N"},
		{fairCase: fairCase{name: "someone else heads the queue now: 2", hash: "A=1", queue: "R:+20000 X:+25000 N:+30000",
			owner: "A", want: "2", wantHash: "R=1", wantQueue: "X:+5000 N:+30000", wantLease: leaseB}, next: "N"},
		{fairCase: fairCase{name: "early: the receiver heads the queue, as believed", hash: "A=1", queue: "R:+20000 N:+25000",
			owner: "A", want: "3", wantHash: "R=1", wantQueue: "N:+5000", wantLease: leaseB}, early: true, next: "N"},
		{fairCase: fairCase{name: "early: another heads the queue after all; the receiver jumps it once", hash: "A=1",
			queue: "X:+20000 R:+25000 N:+30000", grants: "R=45000:3", owner: "A",
			want: "2", wantHash: "R=1", wantQueue: "X:+20000 N:+30000", wantLease: leaseB}, early: true, next: "N"},
		{fairCase: fairCase{name: "early: the receiver was purged; it gets the lock anyway", hash: "A=1",
			queue: "R:+500 X:+20000", owner: "A", at: 1_000,
			want: "2", wantHash: "R=1", wantQueue: "X:+20000", wantLease: leaseB}, early: true},
		{fairCase: fairCase{name: "early, still held: 0, nothing handed over", hash: "A=2", pttl: 1_000, queue: "R:+20000",
			owner: "A", want: "0", wantHash: "A=1", wantQueue: "R:+20000", wantLease: lease}, early: true},
		{fairCase: fairCase{name: "early, not held: nil, nothing handed over", hash: "X=1", queue: "R:+20000", owner: "A",
			want: "nil", wantHash: "X=1", wantQueue: "R:+20000"}, early: true},
		{fairCase: fairCase{name: "early retry after a first try that ran: 2", hash: "R=1", queue: "N:+20000", owner: "A",
			want: "2", wantHash: "R=1", wantQueue: "N:+20000"}, early: true, retry: true},
		{fairCase: fairCase{name: "early retry, neither field there: nil", hash: "X=1", owner: "A",
			want: "nil", wantHash: "X=1"}, early: true, retry: true},
		{fairCase: fairCase{name: "run: the next three head the queue in order: 2+3", hash: "A=1",
			queue: "R:+20000 N:+25000 O:+30000 P:+35000 X:+40000", owner: "A",
			want: "5", wantHash: "R=1", wantQueue: "N:+5000 O:+30000 P:+35000 X:+40000", wantLease: leaseB},
			next: "N", run: []string{"O", "P"}},
		{fairCase: fairCase{name: "run: a foreign waiter between: 2+1", hash: "A=1",
			queue: "R:+20000 N:+25000 X:+30000 O:+35000", owner: "A",
			want: "3", wantHash: "R=1", wantQueue: "N:+5000 X:+30000 O:+35000", wantLease: leaseB},
			next: "N", run: []string{"O"}},
		{fairCase: fairCase{name: "run longer than the queue", hash: "A=1",
			queue: "R:+20000 N:+25000 O:+30000", owner: "A",
			want: "4", wantHash: "R=1", wantQueue: "N:+5000 O:+30000", wantLease: leaseB},
			next: "N", run: []string{"O", "P", "Q"}},
		{fairCase: fairCase{name: "relayed fields leave first; the receiver then heads the queue", hash: "A=1",
			queue: "C:+20000 D:+25000 R:+30000 N:+35000 X:+40000", grants: "C=45000:3 R=45000:4", owner: "A",
			want: "3", wantHash: "R=1", wantQueue: "N:+5000 X:+40000", wantLease: leaseB},
			early: true, next: "N", relayed: []string{"C", "D"}, run: []string{"Y"}},
		{fairCase: fairCase{name: "relayed fields leave even when nothing is handed over", hash: "",
			queue: "C:+20000 R:+30000 X:+40000", owner: "A",
			want: "nil", wantQueue: "R:+30000 X:+40000"},
			early: true, relayed: []string{"C"}},
		{fairCase: fairCase{name: "a relayed field behind the head leaves too", hash: "X=1",
			queue: "X:+20000 C:+25000 R:+30000", owner: "A",
			want: "nil", wantHash: "X=1", wantQueue: "X:+20000 R:+30000"},
			early: true, relayed: []string{"C"}},
		{fairCase: fairCase{name: "relayed fields leave when the lock is still held by another", hash: "X=1",
			queue: "C:+20000 R:+30000", owner: "A",
			want: "nil", wantHash: "X=1", wantQueue: "R:+30000"},
			early: true, relayed: []string{"C"}},
	}
	for _, tc := range cases {
		earlyCases = append(earlyCases, earlyCase{fairCase: tc})
	}
	for i, tc := range earlyCases {
		t.Run(tc.name, func(t *testing.T) {
			f := fairLock(fmt.Sprintf("fh%d", i))
			w := tc.setup(t, e, f)
			flag := func(b bool) string {
				if b {
					return "1"
				}
				return "0"
			}
			args := []string{tc.owner, strconv.Itoa(lease), "R", strconv.Itoa(leaseB), strconv.Itoa(wait), at(tc.at), unlockMsg,
				flag(tc.early), tc.next, flag(tc.retry)}
			if tc.relayed != nil || tc.run != nil {
				args = append(append(append(args, strconv.Itoa(len(tc.relayed))), tc.relayed...), tc.run...)
			}
			rep := e.run(t, scripts.FairHandoff, f.keys(), args...)
			tc.check(t, e, f, w, "fair_handoff", rep)
		})
	}
}

// ---- fair_force_release ----

func TestFairForceRelease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cases := []fairCase{
		{name: "held: deleted, head woken", hash: "A=2", queue: "B:+20000 C:+25000",
			want: "1", wantQueue: "B:+20000 C:+25000", wantWake: []string{"B"}},
		{name: "held, empty queue", hash: "A=1", want: "1"},
		{name: "absent: the head is still woken", queue: "B:+20000", want: "0", wantQueue: "B:+20000", wantWake: []string{"B"}},
		{name: "absent, empty queue", want: "0"},
		{name: "stale head purged, the next is woken", hash: "A=1", queue: "S:+500 B:+20000", at: 1_000,
			want: "1", wantQueue: "B:+20000", wantWake: []string{"B"}},
		{name: "a registered head is woken, not granted", hash: "A=1", queue: "B:+20000", grants: "B=45000:7",
			want: "1", wantQueue: "B:+20000", wantGrants: "B=45000:7", wantWake: []string{"B"}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := fairLock(fmt.Sprintf("ff%d", i))
			w := tc.setup(t, e, f)
			rep := e.run(t, scripts.FairForceRelease, f.keys(), unlockMsg, at(tc.at))
			tc.check(t, e, f, w, "fair_force_release", rep)
		})
	}
}

// ---- moving up and gone waiters ----

// TestFairMoveUpKeepsGoneWaitersDeadline checks the promise of fair_acquire.lua's
// header (shared by fair_leave and fair_handoff): "moving everyone up one place never
// lowers a deadline below now + allowance: a live waiter that keeps asking never
// loses its place, and a gone one loses it an allowance after it stopped asking"
// (README: "FairWaitTimeout after it last refreshed").
//
// C last asked at -2000, so its deadline is +3000 (or, in the second variant, it
// already passed at +500 and C survives only because it is not the head). B, ahead
// of C, moves out of the queue at +1000. C must still lose its place at its old
// deadline, so D, asking then, finds C purged and heads the queue itself.
//
// The scripts instead set every deadline behind to max(d - wait, now + wait), which
// RAISES a deadline already below now + wait: C's becomes +6000, so a waiter whose
// process is gone is given a fresh allowance each time the queue moves up, and
// everyone behind it waits for it (with the default FairWaitTimeout, minutes per
// gone waiter). max(d - wait, min(d, now + wait)) would keep the promise.
func TestFairMoveUpKeepsGoneWaitersDeadline(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	moves := []struct {
		name     string
		hash     string // the lock before B moves out
		move     func(t *testing.T, f fair)
		holder   string // the lock's hash after the move
		leaseNow int64  // its PTTL after the move
		d        int64  // D's deadline after the move: grants leave it, a leave moves it up
	}{
		{name: "fair_acquire", move: func(t *testing.T, f fair) {
			wantReply(t, "B acquires", e.fairAcquire(t, f, "B", 1_000, false), "nil")
		}, holder: "B=1", leaseNow: lease, d: 30_000},
		{name: "fair_handoff", hash: "A=1", move: func(t *testing.T, f fair) {
			wantReply(t, "A hands off to B", e.run(t, scripts.FairHandoff, f.keys(),
				"A", strconv.Itoa(lease), "B", strconv.Itoa(leaseB), strconv.Itoa(wait), at(1_000), unlockMsg), "2")
		}, holder: "B=1", leaseNow: leaseB, d: 30_000},
		{name: "fair_leave", hash: "A=1", move: func(t *testing.T, f fair) {
			wantReply(t, "B leaves", e.run(t, scripts.FairLeave, f.keys(),
				"B", strconv.Itoa(wait), unlockMsg, at(1_000), "1"), "1")
		}, holder: "A=1", leaseNow: defaultPTTL, d: 25_000},
	}
	for i, mv := range moves {
		for j, cDeadline := range []int64{3_000, 500} {
			t.Run(fmt.Sprintf("%s, C's deadline +%d", mv.name, cDeadline), func(t *testing.T) {
				f := fairLock(fmt.Sprintf("gone%d-%d", i, j))
				e.setHash(t, f.name, mv.hash, defaultPTTL)
				e.setQueue(t, f, fmt.Sprintf("B:+20000 C:%+d D:+30000", cDeadline))
				mv.move(t, f)
				e.wantHash(t, f.name, mv.holder)
				if got, want := e.queueState(t, f), fmt.Sprintf("C:%+d D:%+d", cDeadline, mv.d); got != want {
					t.Errorf("after B moved out: queue = %q, want %q (C's deadline must not be raised)", got, want)
				}
				// D asks when C's deadline has passed: C is purged, D heads the queue
				// and waits for the lock's PTTL.
				rep := e.fairAcquire(t, f, "D", max(cDeadline, 1_000), false)
				wantIntIn(t, "D asks after C's deadline", rep, mv.leaseNow-pttlSlack, mv.leaseNow)
				e.wantQueue(t, f, fmt.Sprintf("D:%+d", mv.d))
			})
		}
	}
}
