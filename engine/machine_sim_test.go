package engine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// A seeded random simulation of one client's machine on one plain lock, with the
// scripts run on memRedis: six goroutines share three handles in pairs and
// Lock, Lock with a long wait, TryLock, Acquire and walk away, re-enter and
// Unlock, under the watchdog or with leases that run out within a run; the
// server runs their calls in any order, and answers them in any order; a reply
// may be lost to a transport error whether or not its call ran; unlock messages
// come late; the fake clock jumps to the next timer, and a timer whose time has
// come fires before anything else (as the wheel's would, give or take a tick).
//
// After every step it checks the one thing a goroutine inside relies on: each
// hold some goroutine counts on (granted, received, not yet unlocked) is still
// the owner's hold with at least that count, and the server has its field, unless
// its Lost has closed, a call of its owner ran and the engine has not heard its
// reply yet, or it is an early grant (provisional: it runs under the releasing
// owner's field until the handoff's reply). An Unlock of a shared handle
// releases whatever hold the handle has when it arrives (documented on
// Mutex.Unlock): a goroutine whose own hold was lost can release its partner's,
// and such a hold counts on nothing afterwards. It also checks mutual exclusion
// between the handles (simWorld.exclusion), and the two-client simulation
// (machine_sim_clients_test.go) runs the same steps on two machines.
//
// It found a walked-away grant's whole-field give-back, parked behind a re-entry
// of the same handle, deleting the re-entry's new hold on the server (seed 260;
// see runCleanup), and a re-entry with a short lease whose late reply let another
// handle in while a goroutine of its own was inside with Lost open (seed 3042;
// see shortenForReentry). LEASH_SIM_SEEDS (a count) and LEASH_SIM_FIRST (the first
// seed) run more of them.

// simSeeds is how many seeds a default run tries: about 5 s under -race here.
const simSeeds = 600

// simSteps is the length of one seed's run.
const simSteps = 400

// simCall is a script call the engine sent, run or not yet run on the server.
type simCall struct {
	c      scriptCall
	sentAt time.Time
	ran    bool
	reply  scripts.Reply
}

// simG's states.
const (
	simIdle = iota
	simAcquiring
	simInside
	simReentering
	simUnlocking
)

// simG is one goroutine of the simulation.
type simG struct {
	id        int
	owner     uint64
	state     int
	how       string
	walk      bool // an Acquire whose caller may walk away
	cancelled bool
	fut       *futures.Future[error]
	ctx       context.Context
	cancel    context.CancelFunc
	wid       uint64
	depth     int
	grantHold uint64   // the hold its pending request was granted, once the engine granted it
	stack     []uint64 // the holds it counts on, one per Lock it has not unlocked (0: none found)
}

// simWorld is what the machines of one seed's run share: the random source, the
// server (whose clock moves with every machine's), the step and the trace.
type simWorld struct {
	rnd   *rand.Rand
	mem   *memRedis
	nodes []*sim
	step  int
	trace []string
	mix   int // how often goroutines act rather than the server (per seed)
	// listen: an unlock message reaches only the machines that asked to subscribe
	// to its channel (and have not asked to unsubscribe); otherwise every machine.
	listen bool
	steps  int // how many steps a seed runs
	// tick, when set, moves every clock on at each step, so that a call is sent
	// strictly before anything later is heard, as on a real clock (the engine
	// reads a call's send time after the step that makes it: see doScript, and
	// onRenewDone, which trusts a renewal sent no earlier than a doubt began).
	tick time.Duration
}

// sim is one machine of the simulation (one client) with its goroutines, its
// calls in flight, timers, subscriptions and unlock messages on their way.
type sim struct {
	*simWorld
	name      string // its prefix in the trace ("" when it is the only one)
	h         *mh
	calls     []*simCall
	notices   []string
	subs      []message
	timers    map[timer.Key]time.Time
	gs        []*simG
	nextW     uint64
	cancels   []cancelMsg // walked-away Acquires' cancellations, still on their way
	holdLost  map[uint64]<-chan struct{}
	released  map[uint64]bool // holds an Unlock of another goroutine of the handle released
	listening map[string]bool // channels it asked to subscribe to, and not to unsubscribe from
}

// newSimWorld starts a seed's run: the random source, the server, and how often
// goroutines act.
func newSimWorld(seed uint64, listen bool) *simWorld {
	w := &simWorld{rnd: rand.New(rand.NewPCG(seed, seed*7+1)), mem: newMemRedis(), listen: listen, steps: simSteps}
	w.mem.publish = func(ch, msg string) {
		for _, s := range w.nodes {
			if !w.listen || s.listening[ch] {
				s.notices = append(s.notices, ch)
			}
		}
	}
	return w
}

// addNode adds a machine with goroutines goroutines, goroutine i on handle
// (owner) i%handles+1. The first machine's clock starts the run's; every later
// one starts at the same time.
func (w *simWorld) addNode(t *testing.T, name string, goroutines, handles int, mutate ...func(*config)) *sim {
	s := &sim{simWorld: w, name: name, h: newMH(t, mutate...), timers: map[timer.Key]time.Time{},
		holdLost: map[uint64]<-chan struct{}{}, released: map[uint64]bool{}, listening: map[string]bool{}}
	if len(w.nodes) > 0 {
		s.h.now = w.nodes[0].h.now
	}
	for i := range goroutines {
		s.gs = append(s.gs, &simG{id: i, owner: uint64(i%handles) + 1})
	}
	w.nodes = append(w.nodes, s)
	return s
}

func (w *simWorld) logf(format string, args ...any) {
	w.trace = append(w.trace, fmt.Sprintf("%4d ", w.step)+fmt.Sprintf(format, args...))
}

func (s *sim) logf(format string, args ...any) {
	s.simWorld.logf(s.name+format, args...)
}

// collect takes the machine's effects: calls to the server, timers, subscriptions.
func (s *sim) collect() {
	fx := s.h.take()
	for _, c := range fx.scripts {
		s.calls = append(s.calls, &simCall{c: c, sentAt: s.h.now})
		s.logf("   send %v owner=%d recv=%d args=%v early=%v retried=%v", c.script, c.owner, c.receiver, c.args, c.early, c.retried)
	}
	for _, op := range fx.timers {
		if op.cancel {
			delete(s.timers, op.key)
		} else {
			s.timers[op.key] = s.h.now.Add(op.d)
		}
	}
	for _, op := range fx.subs {
		s.listening[op.channel] = !op.unsubscribe
		if op.unsubscribe {
			s.subs = append(s.subs, unsubscribeDone{lock: op.lock})
		} else {
			s.subs = append(s.subs, subscribeDone{lock: op.lock})
		}
	}
}

// handle runs one message through the machine, then notes, for each pending
// request the machine just granted, the hold it was granted (the owner's hold
// now, whether or not its goroutine ever receives the grant).
func (s *sim) handle(msg message) {
	s.h.m.handle(msg, s.h.now)
	s.collect()
	for _, g := range s.gs {
		if (g.state != simAcquiring && g.state != simReentering) || g.grantHold != 0 || !g.fut.IsCompleted() {
			continue
		}
		// Read the value without receiving it (a received grant is never taken
		// back): take it out and put it back, as only the machine's side may; the
		// machine runs on this goroutine here.
		err, ok := g.fut.Revoke(errConn)
		if !ok {
			continue
		}
		g.fut.Revoke(err)
		if hd := s.h.hold("L", g.owner); err == nil && hd != nil {
			g.grantHold = hd.id
			s.holdLost[hd.id] = hd.lostSignal().C()
		}
	}
}

func simClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// violation returns what breaks the invariant (see the top of the file), or "".
func (s *sim) violation() string {
	need := map[uint64]int{}
	for _, g := range s.gs {
		for _, id := range g.stack {
			if id != 0 {
				need[id]++
			}
		}
	}
	for id, n := range need {
		if s.released[id] || simClosed(s.holdLost[id]) {
			continue
		}
		hd := s.h.m.holdByID[id]
		switch {
		case hd == nil:
			return fmt.Sprintf("step %d: %shold %d ended with %d goroutine(s) counting on it, its Lost open", s.step, s.name, id, n)
		case hd.count < n:
			return fmt.Sprintf("step %d: %shold %d (owner %d) counts %d, %d goroutines count on it", s.step, s.name, id, hd.owner, hd.count, n)
		case hd.provisional || !s.heardOfAll(hd.owner):
		default:
			if got := s.mem.holders("L")[hd.field]; got < int64(n) {
				return fmt.Sprintf("step %d: %shold %d (owner %d, field %s, lease %v, expiry in %v) counted on by %d, the server counts %d", s.step, s.name, id, hd.owner, hd.field, hd.lease, hd.expiresAt.Sub(s.h.now), n, got)
			}
		}
	}
	return ""
}

// heardOfAll reports whether the engine has heard the reply of every call that
// names owner and ran on the server.
func (s *sim) heardOfAll(owner uint64) bool {
	for _, c := range s.calls {
		if c.ran && (c.c.owner == owner || c.c.receiver == owner) {
			return false
		}
	}
	return true
}

// popUnlock takes g's innermost hold off its stack for the Unlock it starts. The
// Unlock releases the handle's current hold: if that is another, the goroutine
// that counts on it no longer can.
func (s *sim) popUnlock(g *simG) {
	top := uint64(0)
	if n := len(g.stack); n > 0 {
		top = g.stack[n-1]
		g.stack = g.stack[:n-1]
	}
	if cur := s.h.hold("L", g.owner); cur != nil && cur.id != top {
		s.released[cur.id] = true
		s.logf("   g%d's Unlock (its hold %d) releases hold %d", g.id, top, cur.id)
	}
}

// newRequest gives g a fresh context, waiter id and future.
func (s *sim) newRequest(g *simG, how string) {
	g.ctx, g.cancel = context.WithCancel(context.Background())
	g.cancelled = false
	s.nextW++
	g.wid = s.nextW
	g.fut = futures.New[error]()
	g.grantHold = 0
	g.walk = false
	g.how = how
}

// gStep moves goroutine g on by one action.
func (s *sim) gStep(g *simG) {
	switch g.state {
	case simIdle:
		var wait time.Duration = -1
		var stop func() bool
		how := "Lock-long"
		switch r := s.rnd.IntN(10); {
		case r < 4:
			how = "Lock"
		case r < 6:
			how = "TryLock"
			wait = time.Duration(s.rnd.IntN(3)) * time.Millisecond
		case r < 8:
			how = "Acquire"
			stop = func() bool { return true }
		}
		s.newRequest(g, how)
		// Most under the watchdog; some with leases that run out within a run.
		lease := []time.Duration{0, 0, 5 * time.Millisecond, 30 * time.Millisecond, 300 * time.Millisecond}[s.rnd.IntN(5)]
		g.walk = how == "Acquire"
		s.logf("g%d (o%d) %s w%d wait=%v", g.id, g.owner, g.how, g.wid, wait)
		g.state = simAcquiring
		s.handle(acquireMsg{id: g.wid, lock: "L", owner: g.owner, wait: wait, lease: lease, ctx: g.ctx, stop: stop, future: g.fut})
	case simAcquiring, simReentering:
		if g.walk && !g.cancelled && s.rnd.IntN(3) == 0 {
			// Acquire's caller took ctx.Done() in its select, grant or no grant;
			// the cancellation (context.AfterFunc) reaches the engine later.
			g.cancel()
			g.cancelled = true
			s.logf("g%d (o%d) walks away from w%d (completed %v)", g.id, g.owner, g.wid, g.fut.IsCompleted())
			s.cancels = append(s.cancels, cancelMsg{id: g.wid, err: g.ctx.Err()})
			g.state = simIdle
			return
		}
		if err, ok := peek(g.fut); ok {
			s.logf("g%d (o%d) %s w%d returned %v", g.id, g.owner, g.how, g.wid, err)
			if err == nil {
				g.stack = append(g.stack, g.grantHold)
				g.depth++
			}
			if g.state == simAcquiring && err != nil {
				g.state = simIdle
				return
			}
			g.state = simInside
			return
		}
		if g.cancelled || g.how == "Lock-long" || s.rnd.IntN(3) != 0 {
			return
		}
		g.cancel()
		g.cancelled = true
		s.logf("g%d (o%d) cancels w%d", g.id, g.owner, g.wid)
		s.handle(cancelMsg{id: g.wid, err: g.ctx.Err()})
		if g.walk {
			g.state = simIdle
		}
	case simInside:
		if g.depth == 1 && s.rnd.IntN(4) == 0 && g.how != "reentry" {
			s.newRequest(g, "reentry")
			s.logf("g%d (o%d) re-entry w%d", g.id, g.owner, g.wid)
			g.state = simReentering
			s.handle(acquireMsg{id: g.wid, lock: "L", owner: g.owner, wait: -1, ctx: g.ctx, future: g.fut})
			return
		}
		s.unlock(g)
	case simUnlocking:
		err, ok := peek(g.fut)
		if !ok {
			return
		}
		s.logf("g%d (o%d) Unlock returned %v", g.id, g.owner, err)
		g.depth--
		if g.depth > 0 {
			s.unlock(g)
			return
		}
		g.state = simIdle
	}
}

func (s *sim) unlock(g *simG) {
	g.fut = futures.New[error]()
	s.logf("g%d (o%d) Unlock (depth %d)", g.id, g.owner, g.depth)
	g.state = simUnlocking
	s.popUnlock(g)
	s.handle(unlockMsg{lock: "L", owner: g.owner, future: g.fut})
}

// runCall runs a call on the server now, once.
func (s *sim) runCall(c *simCall) {
	if c.ran {
		return
	}
	c.ran = true
	c.reply, _ = s.mem.Run(context.Background(), c.c.script, c.c.keys, c.c.args)
}

// callStep has the server act on s's call in flight i: run it and keep the
// reply back, or answer it (run or not, with a reply or a transport error).
func (s *sim) callStep(i int) {
	c := s.calls[i]
	if !c.ran && s.rnd.IntN(3) == 0 {
		s.runCall(c)
		s.logf("run %v owner=%d args=%v -> %+v", c.c.script, c.c.owner, c.c.args, c.reply)
		return
	}
	s.calls = append(s.calls[:i], s.calls[i+1:]...)
	var err error
	switch r := s.rnd.IntN(10); {
	case r == 0 && s.rnd.IntN(2) == 0:
		err = errConn // the reply is lost; the call ran only if it ran before
	case r == 1:
		s.runCall(c)
		err = errConn // it ran, and its reply is lost
	}
	if err == nil {
		s.runCall(c)
		s.logf("reply %v owner=%d recv=%d args=%v -> %+v", c.c.script, c.c.owner, c.c.receiver, c.c.args, c.reply)
	} else {
		s.logf("reply %v owner=%d recv=%d args=%v ran=%v -> transport error", c.c.script, c.c.owner, c.c.receiver, c.c.args, c.ran)
	}
	s.handle(scriptDone{call: c.c, sentAt: c.sentAt, reply: c.reply, err: err})
}

// fireOverdue fires a timer whose time has come, if any, as the wheel would
// before anything else happens, and reports whether it did.
func (w *simWorld) fireOverdue() bool {
	s, k, ok := w.earliestTimer(0)
	if !ok {
		return false
	}
	delete(s.timers, k)
	s.logf("timer %+v (due)", k)
	s.handle(timerFired{key: k})
	return true
}

// earliestTimer returns the timer due first on any machine, within d from now,
// ties broken by machine (the first added first) and key so that a seed runs the
// same way every time.
func (w *simWorld) earliestTimer(d time.Duration) (*sim, timer.Key, bool) {
	var best timer.Key
	var bestS *sim
	var at time.Time
	for _, s := range w.nodes {
		for k, due := range s.timers {
			if due.Sub(s.h.now) > d {
				continue
			}
			if bestS == nil || due.Before(at) || due.Equal(at) && bestS == s && simKeyLess(k, best) {
				best, at, bestS = k, due, s
			}
		}
	}
	return bestS, best, bestS != nil
}

func simKeyLess(a, b timer.Key) bool {
	if a.Kind != b.Kind {
		return a.Kind < b.Kind
	}
	if a.ID != b.ID {
		return a.ID < b.ID
	}
	return a.Gen < b.Gen
}

// advanceClocks moves every machine's clock and the server's on by d.
func (w *simWorld) advanceClocks(d time.Duration) {
	w.mem.advance(d)
	for _, s := range w.nodes {
		s.h.now = s.h.now.Add(d)
	}
}

// fireTimer fires the earliest timer due within 50 ms, moving all clocks to it,
// or moves them on by 1 ms.
func (w *simWorld) fireTimer() {
	s, k, ok := w.earliestTimer(50 * time.Millisecond)
	if !ok {
		w.advanceClocks(time.Millisecond)
		return
	}
	if at := s.timers[k]; at.After(s.h.now) {
		w.advanceClocks(at.Sub(s.h.now))
	}
	delete(s.timers, k)
	s.logf("timer %+v", k)
	s.handle(timerFired{key: k})
}

// pick returns one of the machines for which ok holds, drawing only when there
// is a choice, or nil.
func (w *simWorld) pick(ok func(*sim) bool) *sim {
	var in []*sim
	for _, s := range w.nodes {
		if ok(s) {
			in = append(in, s)
		}
	}
	switch len(in) {
	case 0:
		return nil
	case 1:
		return in[0]
	}
	return in[w.rnd.IntN(len(in))]
}

// nth returns the machine whose list (of lengths given by n, in machine order)
// holds the i-th element of their concatenation, and its index there.
func (w *simWorld) nth(i int, n func(*sim) int) (*sim, int) {
	for _, s := range w.nodes {
		if i < n(s) {
			return s, i
		}
		i -= n(s)
	}
	panic("simWorld.nth: out of range")
}

func (w *simWorld) total(n func(*sim) int) int {
	t := 0
	for _, s := range w.nodes {
		t += n(s)
	}
	return t
}

// violation returns the first thing that breaks an invariant: a machine's
// (sim.violation) or mutual exclusion between handles (exclusion); "" if none.
func (w *simWorld) violation() string {
	for _, s := range w.nodes {
		if bad := s.violation(); bad != "" {
			return bad
		}
	}
	return w.exclusion()
}

// exclusion returns a violation of mutual exclusion, or "": two goroutines of
// different handles, of one machine or of two, that both count on a live hold.
// A hold is live while its Lost is open and no Unlock of another goroutine
// sharing its handle released it (popUnlock); a hold whose goroutine's Unlock is
// in flight is on no stack. A provisional hold is live: it runs under the
// releasing owner's field, which keeps every other handle out (see handoff.go).
// A call in flight of its owner excuses nothing: only Lost tells a goroutine
// inside that it is no longer alone. (A re-entry with a shorter lease than its
// hold's, whose reply comes after that lease ran out, was excused until the
// hold's expiry came forward at the re-entry's send: see shortenForReentry.)
func (w *simWorld) exclusion() string {
	var firstS *sim
	var firstG *simG
	var firstID uint64
	for _, s := range w.nodes {
		for _, g := range s.gs {
			for _, id := range g.stack {
				if id == 0 || s.released[id] || simClosed(s.holdLost[id]) {
					continue
				}
				if firstS == nil {
					firstS, firstG, firstID = s, g, id
					continue
				}
				if firstS != s || firstG.owner != g.owner {
					return fmt.Sprintf("step %d: %sg%d (owner %d) counts on live hold %d and %sg%d (owner %d) on live hold %d",
						w.step, firstS.name, firstG.id, firstG.owner, firstID, s.name, g.id, g.owner, id)
				}
			}
		}
	}
	return ""
}

// run runs the seed's steps and returns the first violation ("" if none) and
// the trace.
func (w *simWorld) run() (string, []string) {
	for w.step = 0; w.step < w.steps; w.step++ {
		if w.tick > 0 {
			w.advanceClocks(w.tick)
		}
		if w.fireOverdue() {
			continue
		}
		if bad := w.violation(); bad != "" {
			return bad, w.trace
		}
		if w.total(func(s *sim) int { return len(s.cancels) }) > 0 && w.rnd.IntN(6) == 0 {
			s := w.pick(func(s *sim) bool { return len(s.cancels) > 0 })
			c := s.cancels[0]
			s.cancels = s.cancels[1:]
			s.logf("cancelMsg w%d", c.id)
			s.handle(c)
			continue
		}
		switch r := w.rnd.IntN(20); {
		case r < w.mix:
			s, i := w.nth(w.rnd.IntN(w.total(func(s *sim) int { return len(s.gs) })), func(s *sim) int { return len(s.gs) })
			s.gStep(s.gs[i])
		case r < 15:
			n := w.total(func(s *sim) int { return len(s.calls) })
			if n > 0 && (r >= w.mix || w.rnd.IntN(2) == 0) {
				s, i := w.nth(w.rnd.IntN(n), func(s *sim) int { return len(s.calls) })
				s.callStep(i)
			}
		case r < 17:
			if n := w.total(func(s *sim) int { return len(s.notices) }); n > 0 {
				s, i := w.nth(w.rnd.IntN(n), func(s *sim) int { return len(s.notices) })
				ch := s.notices[i]
				s.notices = append(s.notices[:i], s.notices[i+1:]...)
				s.logf("unlock message")
				s.handle(unlockNotice{channel: ch, payload: unlockMessage})
			}
		case r < 18:
			if s := w.pick(func(s *sim) bool { return len(s.subs) > 0 }); s != nil {
				msg := s.subs[0]
				s.subs = s.subs[1:]
				if sd, ok := msg.(subscribeDone); ok && sd.lock == 0 {
					continue // the grant channel is never confirmed: no direct grants
				}
				s.logf("subscription %T", msg)
				s.handle(msg)
			}
		default:
			w.fireTimer()
		}
	}
	for w.fireOverdue() { // as before every check
	}
	return w.violation(), w.trace
}

// runSim runs one seed of the one-machine simulation and returns the first
// violation ("" if none) and the trace.
func runSim(t *testing.T, seed uint64) (string, []string) {
	w := newSimWorld(seed, false)
	w.mix = 4 + w.rnd.IntN(10)
	w.addNode(t, "", 6, 3)
	return w.run()
}

// simSeedRange returns the seeds to run: LEASH_SIM_SEEDS (a count, def by
// default) from LEASH_SIM_FIRST (1 by default).
func simSeedRange(t *testing.T, def uint64) (first, n uint64) {
	n, first = def, 1
	if v := os.Getenv("LEASH_SIM_SEEDS"); v != "" {
		x, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("LEASH_SIM_SEEDS=%q: %v", v, err)
		}
		n = x
	}
	if v := os.Getenv("LEASH_SIM_FIRST"); v != "" {
		x, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("LEASH_SIM_FIRST=%q: %v", v, err)
		}
		first = x
	}
	return first, n
}

// runSimSeeds runs run on each seed, and on a violation logs the seed's trace.
func runSimSeeds(t *testing.T, def uint64, run func(*testing.T, uint64) (string, []string)) {
	first, n := simSeedRange(t, def)
	for seed := first; seed < first+n; seed++ {
		bad, trace := run(t, seed)
		if bad != "" {
			t.Logf("trace of seed %d:\n%s", seed, strings.Join(trace, "\n"))
			t.Fatalf("seed %d: %s", seed, bad)
		}
	}
}

// TestMachineSimSharedHandles runs the simulation for simSeeds seeds (see the top
// of the file), and on a violation logs the seed's trace.
func TestMachineSimSharedHandles(t *testing.T) {
	runSimSeeds(t, simSeeds, runSim)
}
