package engine

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// Subscriber is the pub/sub registry as the engine uses it (package pubsub
// implements it). The engine calls it from I/O goroutines, never from the loop.
type Subscriber interface {
	// Subscribe subscribes channel and returns once messages on it will be
	// delivered, or with an error; after an error the channel may still be
	// subscribed later, followed by a Resubscribed call.
	Subscribe(ctx context.Context, channel string) error
	// Unsubscribe drops channel.
	Unsubscribe(ctx context.Context, channel string)
	// PSubscribe and PUnsubscribe do the same for a glob pattern; fair locks need
	// them.
	PSubscribe(ctx context.Context, pattern string) error
	PUnsubscribe(ctx context.Context, pattern string)
}

// Config configures an Engine.
type Config struct {
	// ClientID prefixes every owner field: "<ClientID>:<owner>". Required.
	ClientID string
	// Watchdog is the lease of holds acquired without an explicit one; they are
	// renewed every Watchdog/3. Required.
	Watchdog time.Duration
	// Runner runs the Lua scripts. Required.
	Runner scripts.Runner
	// Subscriber keeps the unlock-channel subscriptions. Required.
	Subscriber Subscriber
	// Scheduler, when set, replaces the timing wheel (tests pass a fake). The engine
	// owns it and stops it on Close.
	Scheduler func(sink timer.Sink) timer.Scheduler
	// OpTimeout bounds each subscription. Script calls are bounded by the client's
	// connection timeout instead (see runScript). Default 10 s.
	OpTimeout time.Duration
	// CloseTimeout bounds the releases Close makes. Default 5 s.
	CloseTimeout time.Duration
	// AbortIO, when set, is called if Close's releases and the calls in flight have
	// not finished within CloseTimeout; it must make them fail at once (lockapi
	// closes the rueidis client it created). Without it, Close waits for the calls,
	// which the connection's timeout bounds.
	AbortIO func()
	// HandoffChain and HandoffAge bound a chain of direct local handoffs before the
	// lock is released to every process. Defaults DefaultHandoffChain and
	// DefaultHandoffAge; a negative HandoffChain disables direct handoffs.
	HandoffChain int
	HandoffAge   time.Duration
	// Linger is how long an idle lock keeps its subscription. Default 250 ms.
	Linger time.Duration
	// FairWait is the fair lock's wait allowance (Redisson's fairLockWaitTimeout):
	// how long a queued waiter whose process is gone keeps its place. Default 5 min.
	FairWait time.Duration
	// PublicYield is how long a head that need not race waits before it tries for
	// a lock released to everyone (see yieldToPublic in directgrant.go). Default
	// 1 ms, the timing wheel's tick (the wheel rounds down: the wait is up to a
	// tick); negative: no wait.
	PublicYield time.Duration
}

// Engine is the loop around the state machine. Its methods are safe for concurrent
// use. All lock state is the machine's, stepped under mu: by the engine goroutine
// (loop), by a caller of AcquireWait or Unlock that finds the loop idle (see
// tryDirect), by a batch's sender with the batch's replies (see sender), or by
// the pub/sub reader with an unlock or grant message that finds the engine idle
// (see stepNotice).
type Engine struct {
	// mu guards the machine, the I/O counts below (inflight, pending, sends) and
	// the slices kept for reuse (spares, spareCalls, spareResults). Nobody holds
	// it across I/O or a blocking channel operation.
	mu        sync.Mutex
	m         *machine
	runner    scripts.Runner
	sub       Subscriber
	scheduler timer.Scheduler
	opTimeout time.Duration

	// inbox carries callers' requests. Its capacity absorbs a burst of callers
	// without making them wait on the loop; past it, callers block until the loop
	// catches up, their context ends, or the engine stops (backpressure, not loss).
	inbox chan message
	// queued counts requests accepted by send and not yet handled: a caller may
	// step the machine itself only when none is (tryDirect), or a request could
	// overtake one its own goroutine sent earlier.
	queued atomic.Int64
	// mail carries firings, unlock messages, cancellations and the replies of
	// calls not sent by a sender; it never blocks whoever posts (see mailbox).
	mail *mailbox

	nextWaiter atomic.Uint64
	nextOwner  atomic.Uint64

	// gate orders requests before Close: senders hold it shared while they send, and
	// Close takes it exclusively to set closed, so every request accepted is in the
	// inbox before closeMsg and is answered.
	gate      sync.RWMutex
	closed    bool
	closeOnce sync.Once
	done      chan struct{}   // closed when the loop has returned
	ioCtx     context.Context // subscriptions run under it; Close cancels it
	ioCancel  context.CancelFunc
	abortIO   func()
	ioWG      sync.WaitGroup // I/O goroutines
	inflight  int            // I/O calls not yet answered
	// pending holds script calls waiting for a send slot (or for a fuller batch:
	// waitForFill), and sends counts the batches in flight, a caller's own call
	// included (both under mu; see takePending and takeLone).
	pending []scriptCall
	sends   int
	// spares are answered batches' backing arrays, emptied, for the next pending
	// calls (see recycle): under load a batch holds dozens of calls, and growing a
	// new slice for each would allocate about a kilobyte per lock operation. One
	// spare per send slot: the batches in flight and pending make one array more.
	spares [maxSends][]scriptCall
	// pendingUrgent counts the pending calls that may not wait for a fill, and
	// fillable the calls in flight that may (see waitForFill).
	pendingUrgent int
	fillable      int
	// spareCalls and spareResults are the slices of the runner's view of a
	// batch and of its results (see sender) that the last sender to return left
	// for the next one to start with.
	spareCalls   []scripts.Call
	spareResults []scripts.Result
	closeT       time.Duration
}

const inboxSize = 1024

// The chain bound's defaults (Config.HandoffChain, Config.HandoffAge): a process
// whose waiters pass a lock among themselves keeps it for at most 16 handoffs or
// 20 ms, whichever comes first, before it lets other processes have it; so a
// process with waiters waits at most one such chain per other process.
//
// The age bound prices a crossing. Handing the lock to another process costs a
// script call, a pub/sub delivery and a wake-up of the other process: measured on
// a two-core VM, about 0.46 ms per crossing against 35 µs per local handoff. A
// chain that crosses every 5 ms (the first default) left about a tenth of the
// lock's time idle with 1 ms holds from 10 processes (harness scenario C: 92-94 %
// of the physical limit); every 20 ms, about 3 % (96.8-96.9 %). Go's sync.Mutex
// makes the same trade in-process, where a handoff costs microseconds and its
// starvation threshold is 1 ms. The count bound keeps chains of short holds short.
const (
	DefaultHandoffChain = 16
	DefaultHandoffAge   = 20 * time.Millisecond
)

// maxSends is how many batches of script calls may be in flight at once. While
// all are out (or, for some calls, while the pending ones are too few to take a
// slot of their own: waitForFill), new calls wait and go together in the next
// batch, as one merged script call (scripts.RunBatch): under load, batches grow
// instead of the number of writes, wake-ups and Lua calls per lock operation; a
// lone call still goes at once.
//
// Measured on two cores with 256 goroutines on their own locks (bench scenario B,
// interleaved runs of three repetitions each, leash's ops/s ÷ rueidislock's in the
// same run): two slots made 1.32-1.54× (median 1.40×, 15 runs), three 1.26-1.70×
// (1.55×, 15 runs), four 1.45-1.77× (1.58×, 11 runs), six and eight no more than
// four (1.55× each, 5 runs each); leash's own ops/s, median of the runs, four
// against two: 96,700 against 82,500. With more slots a batch is on the server
// while the replies of others are stepped and the calls they free gathered;
// beyond four, batches only get smaller. The contended scenarios (A, C, D)
// measured the same with four as with two. (When this was first measured, on an
// earlier engine, three, four and eight slots did no better than two.) Those
// figures predate waitForFill, which keeps single calls from taking slots alone.
const maxSends = 4

// wakeMsg only wakes the loop: a caller (runDirect) or a sender answered the last
// call in flight of a closing engine, and the loop may return.
type wakeMsg struct{}

func (wakeMsg) isMessage() {}

// batchDone: the calls of a merged batch (doBatch) returned, results[i] being
// calls[i]'s. One message for the whole batch, rather than a scriptDone per call:
// the batch's sender steps it (Engine.step hands each call to the machine as its
// scriptDone, done) and then keeps calls' backing array (recycle). Only a sender
// makes and steps one; it never goes through the mailbox.
type batchDone struct {
	calls   []scriptCall
	results []scripts.Result
	sentAt  time.Time
}

func (batchDone) isMessage() {}

// done is the scriptDone of the batch's call i, dated at the batch's send, or
// at its unit's later send after NOSCRIPT (see sentAtOf).
func (b batchDone) done(i int) scriptDone {
	r := b.results[i]
	return scriptDone{call: b.calls[i], sentAt: sentAtOf(r.Reply, b.sentAt), reply: r.Reply, err: r.Err}
}

// sentAtOf is when the command that answered a call was sent: reply.SentAt when
// the runner sent a later command than the first (a script after a refused
// RESTORE, a retry after NOSCRIPT), otherwise sentAt, the call's first send. A
// grant dated at the first send could look older than a ForceUnlock sent in
// between, whose reply would then end it as deleted (onForceDone).
func sentAtOf(reply scripts.Reply, sentAt time.Time) time.Time {
	if !reply.SentAt.IsZero() {
		return reply.SentAt
	}
	return sentAt
}

// New starts an engine.
func New(cfg Config) (*Engine, error) {
	if cfg.ClientID == "" || cfg.Watchdog <= 0 || cfg.Runner == nil || cfg.Subscriber == nil {
		return nil, errors.New("leash: engine config needs ClientID, Watchdog, Runner and Subscriber")
	}
	if cfg.OpTimeout <= 0 {
		cfg.OpTimeout = 10 * time.Second
	}
	if cfg.CloseTimeout <= 0 {
		cfg.CloseTimeout = 5 * time.Second
	}
	if cfg.HandoffChain == 0 {
		cfg.HandoffChain = DefaultHandoffChain
	}
	if cfg.HandoffAge <= 0 {
		cfg.HandoffAge = DefaultHandoffAge
	}
	if cfg.Linger == 0 {
		cfg.Linger = 250 * time.Millisecond
	}
	if cfg.FairWait <= 0 {
		cfg.FairWait = 5 * time.Minute
	}
	if cfg.PublicYield == 0 {
		cfg.PublicYield = timer.Tick
	}
	e := &Engine{
		m: newMachine(config{
			clientID:     cfg.ClientID,
			watchdog:     cfg.Watchdog,
			handoffChain: cfg.HandoffChain,
			handoffAge:   cfg.HandoffAge,
			linger:       cfg.Linger,
			fairWait:     cfg.FairWait,
			publicYield:  max(cfg.PublicYield, 0),
		}),
		runner:    cfg.Runner,
		sub:       cfg.Subscriber,
		opTimeout: cfg.OpTimeout,
		closeT:    cfg.CloseTimeout,
		abortIO:   cfg.AbortIO,
		inbox:     make(chan message, inboxSize),
		mail:      newMailbox(),
		done:      make(chan struct{}),
	}
	e.m.deferGrants = true
	e.ioCtx, e.ioCancel = context.WithCancel(context.Background())
	sink := func(k timer.Key) { e.mail.post(timerFired{key: k}) }
	if cfg.Scheduler != nil {
		e.scheduler = cfg.Scheduler(sink)
	} else {
		e.scheduler = timer.NewWheel(sink)
	}
	go e.loop()
	return e, nil
}

// NewOwner returns a fresh owner id: each lock handle is one owner.
func (e *Engine) NewOwner() uint64 { return e.nextOwner.Add(1) }

// NotifyMessage hands an unlock-channel message to the engine. It never blocks; it
// is the pub/sub registry's message handler. When the engine is idle it steps the
// message on the calling goroutine (see stepNotice); otherwise the loop does.
func (e *Engine) NotifyMessage(channel, payload string) {
	msg := unlockNotice{channel: channel, payload: payload}
	if !e.stepNotice(msg) {
		e.mail.post(msg)
	}
}

// stepNotice steps msg, an unlock or grant message, on the calling goroutine (the
// pub/sub connection's reader) when nobody holds mu and nothing waits in the
// mailbox, as a sender steps its replies: a message that hands this process the
// lock then reaches the granted caller without the hop through the loop
// goroutine, one wake-up less between the release and the caller's return.
// Measured (bench/ scenario D, a waiter in another client, 5 interleaved runs
// of about 530 samples each): p50 49 → 43 µs, p99 240 → 212 µs. It never waits
// for the engine: it only tries mu, and the effects it applies run their I/O on
// goroutines of their own. It reports false, having done nothing, when the
// engine is busy or closing: the message then goes through the mailbox, after
// what is there already, so messages keep their order. (The second look at the
// mailbox, under mu, catches a post the loop has been nudged for but not yet
// drained; no test can hold the loop at that point without a hook.)
//
// When the step granted the lock to a caller here, the reader yields its
// thread (runtime.Gosched) once mu is free: the granted caller, readied last,
// runs at once instead of after the reader has gone back to its connection and
// parked. Measured (scenario D only, three alternated pairs of runs, four
// repetitions each): the Mutex's p50 39/41/44 → 32/34/36 µs and the fair
// lock's 54/52/50 → 40/48/41 µs; the p99s moved within the runs' noise.
func (e *Engine) stepNotice(msg message) bool {
	if !e.mail.empty() || !e.mu.TryLock() {
		return false
	}
	if e.m.closing || !e.mail.empty() {
		e.mu.Unlock()
		return false
	}
	e.step(msg, time.Now())
	granted := len(e.m.grantsDue) > 0
	e.apply()
	e.mu.Unlock()
	if granted {
		runtime.Gosched()
	}
	return true
}

// NotifyResubscribed tells the engine that messages may have been missed. It never
// blocks.
func (e *Engine) NotifyResubscribed() { e.mail.post(resubscribed{}) }

// AcquireRequest describes one Acquire.
type AcquireRequest struct {
	Lock  string
	Owner uint64
	Fair  bool          // the fair (FIFO across processes) protocol
	Lease time.Duration // 0: watchdog
	Wait  time.Duration // < 0: until ctx ends; 0: one attempt; > 0: at most this long
}

// Acquire asks for the lock. The returned channel carries exactly one value and is
// never closed: nil when the owner holds the lock (a received nil means held,
// whatever ctx did afterwards); ctx's error when ctx ended first; ErrNotAcquired
// when the wait ran out; ErrClosed; or a Redis error.
//
// If ctx ends after the grant was sent but before anyone received it, the grant is
// taken back and released, and the channel carries ctx's error instead.
func (e *Engine) Acquire(ctx context.Context, req AcquireRequest) <-chan error {
	f := futures.New[error]()
	id := e.nextWaiter.Add(1)
	var stop func() bool
	if ctx.Done() != nil {
		stop = context.AfterFunc(ctx, func() { e.mail.post(cancelMsg{id: id, err: ctx.Err()}) })
	}
	msg := acquireMsg{id: id, lock: req.Lock, owner: req.Owner, fair: req.Fair, lease: req.Lease, wait: req.Wait, ctx: ctx, stop: stop, future: f}
	if err := e.send(ctx, msg); err != nil {
		if stop != nil {
			stop()
		}
		f.Complete(WrapError(req.Lock, err))
	}
	return f.C()
}

// AcquireWait is Acquire for a caller that waits for the answer itself, and so
// always receives it: it returns the value Acquire's channel would carry.
//
// It registers nothing on ctx. Acquire watches ctx with context.AfterFunc, and
// keeps watching it after a grant until the hold ends, in case its caller walks
// away without receiving; that is a registration on ctx per acquisition (a lock on
// ctx's parent, shared by every goroutine that uses it) and the engine's receipt
// bookkeeping. AcquireWait's caller instead selects on ctx.Done() itself and, if
// ctx ends first, tells the engine and still waits for the answer: ctx's error, or
// nil if the grant came first (then it holds the lock).
//
// When the engine is idle, the caller runs its attempt's script call itself (see
// tryDirect); an attempt in flight is waited for whether ctx ends or not, here as
// through the engine goroutine.
func (e *Engine) AcquireWait(ctx context.Context, req AcquireRequest) error {
	env := new(acquireEnvelope)
	f := &env.future
	f.Init()
	id := e.nextWaiter.Add(1)
	env.msg = acquireMsg{id: id, lock: req.Lock, owner: req.Owner, fair: req.Fair, lease: req.Lease, wait: req.Wait, ctx: ctx, future: f}
	if !e.tryDirect(ctx, &env.msg) {
		if err := e.send(ctx, &env.msg); err != nil {
			return WrapError(req.Lock, err)
		}
	}
	select {
	case err := <-f.C():
		return err
	case <-ctx.Done():
	}
	e.mail.post(cancelMsg{id: id, err: ctx.Err()})
	return <-f.C() // every waiter is answered, on Close too
}

// Unlock releases one hold of owner on lock. The release goes ahead under the
// engine's own bounded context even if ctx is already done (a dead context must not
// leave the lock held until its lease ends); ctx only bounds how long the caller
// waits for the answer, except that a release the caller runs itself (when the
// engine is idle and the release is the step's only call: see tryDirect) is
// waited for, like a Lock's attempt in flight: if ctx ends while it is at the
// server, Unlock returns once it is answered (within the connection's timeout):
// its answer, or ctx's error if it failed and its retry went to the loop.
func (e *Engine) Unlock(ctx context.Context, lock string, owner uint64) error {
	env := new(unlockEnvelope)
	f := &env.future
	f.Init()
	env.msg = unlockMsg{lock: lock, owner: owner, future: f}
	// A caller whose ctx has ended already gets its error at once, while the
	// release goes ahead on the engine's goroutines.
	if ctx.Err() != nil || !e.tryDirect(ctx, &env.msg) {
		if err := e.send(context.Background(), &env.msg); err != nil {
			return err
		}
	}
	select {
	case err := <-f.C(): // answered already, as a direct release is
		return err
	default:
		return wait(ctx, f)
	}
}

// ForceUnlock deletes lock whoever holds it and reports whether it existed.
func (e *Engine) ForceUnlock(ctx context.Context, lock string, fair bool) (bool, error) {
	f := futures.New[forceResult]()
	if err := e.send(ctx, forceUnlockMsg{lock: lock, fair: fair, future: f}); err != nil {
		return false, err
	}
	select {
	case r := <-f.C():
		return r.existed, r.err
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

// Lost returns the signal of owner's current hold on lock: closed when the hold is
// lost, never sent on; already closed when owner holds nothing (or the engine is
// closed).
func (e *Engine) Lost(lock string, owner uint64) <-chan struct{} {
	f := futures.New[<-chan struct{}]()
	if err := e.send(context.Background(), lostMsg{lock: lock, owner: owner, future: f}); err != nil {
		return futures.FiredC()
	}
	select {
	case c := <-f.C():
		return c
	case <-e.done:
		return futures.FiredC()
	}
}

// Settle returns once no Unlock, re-entry, attempt or local handoff of owner's (to
// it or from it) on lock is in flight, and the give-backs of the owner's that were
// in flight when it was called have been answered (releases of grants nobody
// received: a cancelled Lock's, a fair leave's, a lost hold's clean-up), so that
// what Redis then says of the owner's hold reflects every call that has returned,
// and an early-granted hold (see handoff.go) is on the server. An Acquire whose
// caller took its context's end counts as returned: its waiter is cancelled and
// an unreceived grant taken back first, if their cancellation has not come yet.
// It returns ctx's error if ctx ends first, and ErrClosed once the engine is closed.
func (e *Engine) Settle(ctx context.Context, lock string, owner uint64) error {
	f := futures.New[error]()
	if err := e.send(ctx, settleMsg{lock: lock, owner: owner, future: f}); err != nil {
		return err
	}
	select {
	case err := <-f.C():
		return err
	case <-ctx.Done():
		return ctx.Err()
	case <-e.done:
		return ErrClosed
	}
}

// HoldField returns the hash field under which owner holds lock, as far as the
// engine knows: its handle's field (OwnerField), or, for a hold that came from a
// direct grant, the grant's own field. It returns "" when owner holds nothing.
func (e *Engine) HoldField(ctx context.Context, lock string, owner uint64) (string, error) {
	f := futures.New[string]()
	return ask(e, ctx, fieldMsg{lock: lock, owner: owner, future: f}, f)
}

// Stats returns a snapshot of the engine's counters.
func (e *Engine) Stats(ctx context.Context) (Stats, error) {
	f := futures.New[Stats]()
	return ask(e, ctx, statsMsg{future: f}, f)
}

// ask sends msg, whose answer f carries, and waits for that answer, ctx's end
// or the engine's.
func ask[T any](e *Engine, ctx context.Context, msg message, f *futures.Future[T]) (T, error) {
	var zero T
	if err := e.send(ctx, msg); err != nil {
		return zero, err
	}
	select {
	case v := <-f.C():
		return v, nil
	case <-ctx.Done():
		return zero, ctx.Err()
	case <-e.done:
		return zero, ErrClosed
	}
}

func wait(ctx context.Context, f *futures.Future[error]) error {
	select {
	case err := <-f.C():
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// send puts a request on the inbox. It fails with ErrClosed once Close has begun and
// with ctx's error if ctx ends while the inbox is full.
func (e *Engine) send(ctx context.Context, msg message) error {
	e.gate.RLock()
	defer e.gate.RUnlock()
	if e.closed {
		return ErrClosed
	}
	e.queued.Add(1)
	select {
	case e.inbox <- msg:
		return nil
	case <-ctx.Done():
		e.queued.Add(-1)
		return ctx.Err()
	}
}

// Close fails pending waiters with ErrClosed, closes the Lost signal of every hold
// and releases it on the server (bounded by CloseTimeout), stops renewals and
// timers, and returns once every goroutine the engine started has ended. It is
// idempotent; later calls wait for the first to finish.
func (e *Engine) Close() {
	e.closeOnce.Do(func() {
		e.gate.Lock()
		e.closed = true
		e.gate.Unlock()
		// The loop stops reading the inbox only after it has handled closeMsg, so
		// this send cannot be lost; requests queued before it are answered first.
		e.inbox <- closeMsg{}
		// Bound the releases and any call still in flight (a paused server).
		timeout := time.AfterFunc(e.closeT, func() {
			e.ioCancel()
			if e.abortIO != nil {
				e.abortIO()
			}
		})
		<-e.done
		timeout.Stop()
		e.ioWG.Wait()
		e.scheduler.Stop()
		e.ioCancel()
	})
	<-e.done
}

// loop is the engine goroutine: receive, step the machine, carry out the effects.
func (e *Engine) loop() {
	defer close(e.done)
	for {
		select {
		case msg := <-e.inbox:
			e.mu.Lock()
			now := time.Now()
			e.request(msg, now)
			// Drain what else is queued, so one round of effects serves a burst; one
			// reading of the clock serves it too.
			for n := len(e.inbox); n > 0; n-- {
				e.request(<-e.inbox, now)
			}
		case <-e.mail.signal:
			e.mu.Lock()
			msgs := e.mail.drain()
			// Read after the drain, so that no reply stepped here came after now
			// (renewMayFollow compares reply and send times).
			now := time.Now()
			for _, msg := range msgs {
				e.step(msg, now)
			}
		}
		e.apply()
		stop := e.drained()
		e.mu.Unlock()
		if stop {
			return
		}
	}
}

// request hands one inbox message to the machine. Called under mu.
func (e *Engine) request(msg message, now time.Time) {
	e.m.handle(msg, now)
	if _, isClose := msg.(closeMsg); !isClose {
		e.queued.Add(-1) // every request but Close's own came through send
	}
}

// step hands one mailbox message, or a sender's reply, to the machine, keeping the
// I/O counts. Called under mu.
func (e *Engine) step(msg message, now time.Time) {
	switch msg := msg.(type) {
	case wakeMsg:
		return
	case batchDone:
		for i := range msg.calls {
			e.callAnswered(&msg.calls[i])
			e.m.handleDone(msg.done(i), now)
		}
		return
	case scriptDone:
		e.callAnswered(&msg.call)
	case subscribeDone, unsubscribeDone:
		e.inflight--
	}
	e.m.handle(msg, now)
}

// drained reports whether a closing engine has nothing left in flight, so that the
// loop may return. Called under mu.
func (e *Engine) drained() bool {
	return e.m.closing && e.inflight == 0 && len(e.pending) == 0
}

// apply carries out the machine's effects, starting a sender for the pending
// calls if a send slot is free.
func (e *Engine) apply() { e.applyEffects(false) }

// applyKeeping is apply for a sender: pending calls that may go now are returned
// for the sender to send itself (the slot counted), instead of starting another.
func (e *Engine) applyKeeping() (sendJob, bool) { return e.applyEffects(true) }

// applyEffects carries out the machine's effects; see apply and applyKeeping.
// Grants are completed last, after any goroutine is started (see machine.deliver:
// a goroutine started after them would run before the granted caller).
func (e *Engine) applyEffects(keep bool) (sendJob, bool) {
	fx := &e.m.fx
	for _, op := range fx.timers {
		if op.cancel {
			e.scheduler.Cancel(op.key)
		} else {
			e.scheduler.Schedule(op.key, op.d)
		}
	}
	var (
		job  sendJob
		send bool
	)
	if _, ok := e.runner.(scripts.BatchRunner); ok {
		e.pending = append(e.pending, fx.scripts...)
		for i := range fx.scripts {
			if !mayWaitForFill(&fx.scripts[i]) {
				e.pendingUrgent++
			}
		}
		job, send = e.takePending()
		if send && !keep {
			job.calls, job.results = e.spareCalls, e.spareResults
			e.spareCalls, e.spareResults = nil, nil
			e.ioWG.Add(1)
			go e.sender(job)
			job, send = sendJob{}, false
		}
	} else {
		// A runner without batches (the tests' fakes): every call at once.
		for _, call := range fx.scripts {
			e.callSent(&call)
			e.ioWG.Add(1)
			go e.runScript(call)
		}
	}
	for _, op := range fx.subs {
		e.inflight++
		e.ioWG.Add(1)
		go e.runSub(op)
	}
	e.m.flushGrants() // after the I/O goroutines: see machine.deliver
	fx.reset()
	return job, send
}

// waitForFill reports whether the pending calls wait for more before taking a
// free send slot: while other sends are in flight, calls that only their own
// callers wait for (mayWaitForFill) take a slot of their own once they are a
// maxSends-th of all such calls outstanding (in flight and pending), so the
// slots share the load evenly. Calls of other kinds in flight do not count: a
// fresh attempt does not wait behind a round of renewals. Until then they
// wait for a fuller batch, an urgent call (any other call, which takes them
// along), Close, or the calls of their kind in flight to come back, after
// which they go whatever their number: at most a round trip. A local waiter
// queued behind a held-back fresh attempt waits with it (it makes no call while
// that attempt is in flight).
//
// Without this, under load most sends were single calls: a send coming back
// completes its calls, and the first of their callers to call again found a free
// slot and took it alone, for a whole round trip (measured in bench scenario B,
// 256 goroutines on their own locks: 42% of about 2,000 sends per half second
// carried one call). With it, interleaved runs of B on two cores made 87,200 and
// 89,800 ops/s against 77,000 and 80,700 without (leash ÷ rueidislock 1.59× and
// 1.62× against 1.39× and 1.42×), with about a third fewer merged calls and a
// tenth less client CPU per operation; the contended scenarios (A, C, D), whose
// calls are handoffs, joins and releases others wait for, measured the same.
// Called under mu.
func (e *Engine) waitForFill() bool {
	if e.sends == 0 || e.pendingUrgent > 0 || e.m.closing {
		return false
	}
	return len(e.pending)*maxSends < e.fillable+len(e.pending)
}

// mayWaitForFill reports whether c is a call that only its own caller waits for,
// which may wait for a fuller send (waitForFill): a first attempt on a lock that
// looks free here (scriptCall.fresh) or a release nobody here waits behind
// (scriptCall.quiet), not sent before. Handoffs, joins, retries, releases sent
// again, releases that pass a lock on, renewals and clean-ups go at once.
func mayWaitForFill(c *scriptCall) bool { return (c.fresh || c.quiet) && !c.retried }

// sendJob is a batch of calls taken from pending for one send slot.
type sendJob struct {
	batch []scriptCall
	// lone is the runner's lone lane when the batch is one call and nothing else is
	// in flight (a dedicated connection read on the sender's goroutine: at most one
	// call uses it at a time); nil otherwise.
	lone scripts.LoneRunner
	// calls and results, for a sender's first job, are the spare slices it
	// reuses for the runner's view of its batches and their results
	// (Engine.spareCalls).
	calls   []scripts.Call
	results []scripts.Result
}

// takePending takes the pending calls as one batch if a send slot is free (see
// maxSends) and they need not wait for more (waitForFill), counting it and its
// calls in flight. Called under mu.
func (e *Engine) takePending() (sendJob, bool) {
	if len(e.pending) == 0 || e.sends >= maxSends || e.waitForFill() {
		return sendJob{}, false
	}
	job := sendJob{batch: e.pending}
	e.pending = e.takeSpare()
	e.pendingUrgent = 0
	if lone, ok := e.runner.(scripts.LoneRunner); ok && len(job.batch) == 1 && e.sends == 0 {
		job.lone = lone
	}
	e.sends++
	for i := range job.batch {
		e.callSent(&job.batch[i])
	}
	return job, true
}

// callSent counts c in flight, and among the calls that may wait for a fill
// (waitForFill) if it is one; callAnswered, when its reply is stepped, undoes
// it. Called under mu.
func (e *Engine) callSent(c *scriptCall) {
	e.inflight++
	if mayWaitForFill(c) {
		e.fillable++
	}
}

func (e *Engine) callAnswered(c *scriptCall) {
	e.inflight--
	if mayWaitForFill(c) {
		e.fillable--
	}
}

// sender sends a batch (one pipelined write, merged by the runner into few script
// calls), steps the machine with the replies on its own goroutine, and goes on with
// the calls pending by then, while takePending gives them to it; then it returns. The
// replies skip the mailbox and the loop's wake-up, and a busy engine keeps its
// senders (and their grown stacks) instead of starting a goroutine per batch.
// Like runDirect, a sender's step may go ahead of mailbox items already posted:
// those come from other goroutines (the timer wheel, the pub/sub registry,
// context.AfterFunc), whose posts race with the reply's arrival anyway.
func (e *Engine) sender(job sendJob) {
	defer e.ioWG.Done()
	// The runner's view of each batch, and the slice its results come in, reused.
	calls, results := job.calls, job.results
	for {
		var done message
		switch {
		case job.lone != nil:
			done = doLone(job.lone, job.batch[0])
		case len(job.batch) == 1 && !job.batch[0].fresh && !job.batch[0].quiet:
			// One call alone goes as itself; a fresh attempt or a quiet release
			// goes through RunBatch, which sends it as plain commands.
			done = e.doScript(job.batch[0])
		default:
			calls = calls[:0]
			for _, c := range job.batch {
				calls = append(calls, scripts.Call{ID: c.script, Keys: c.keys, Args: c.args, Fresh: c.fresh, Quiet: c.quiet})
			}
			bd := e.doBatch(e.runner.(scripts.BatchRunner), job.batch, calls, results)
			results = bd.results
			done = bd
			clear(calls)
		}
		e.mu.Lock()
		e.sends--
		e.step(done, time.Now())
		e.recycle(job.batch) // stepped: the machine keeps no reference to it
		clear(results)       // stepped: handleDone took copies
		next, more := e.applyKeeping()
		if e.drained() {
			e.mail.post(wakeMsg{}) // the loop waits for this batch before it returns
		}
		if !more && cap(calls) > cap(e.spareCalls) && cap(calls) <= maxSpare && cap(results) <= maxSpare {
			e.spareCalls, e.spareResults = calls[:0], results[:0]
		}
		e.mu.Unlock()
		if !more {
			return
		}
		job = next
	}
}

// maxSpare bounds the backing array recycle keeps: a burst of thousands of calls
// (Close's releases, a renewal round of many locks) would otherwise pin its array
// for the engine's life. Four merged calls' worth covers the batches of steady load.
const maxSpare = 4 * scripts.MaxMerged

// takeSpare returns the largest spare backing array (nil if none) and forgets it.
func (e *Engine) takeSpare() []scriptCall {
	best := -1
	for i, a := range e.spares {
		if a != nil && (best < 0 || cap(a) > cap(e.spares[best])) {
			best = i
		}
	}
	if best < 0 {
		return nil
	}
	a := e.spares[best]
	e.spares[best] = nil
	return a
}

// recycle keeps an answered batch's backing array as a spare for the next
// pending calls, after dropping its references: in a free spare slot, or in
// place of a smaller spare.
func (e *Engine) recycle(batch []scriptCall) {
	clear(batch)
	if cap(batch) > maxSpare {
		return
	}
	smallest := 0
	for i, a := range e.spares {
		if a == nil {
			e.spares[i] = batch[:0]
			return
		}
		if cap(a) < cap(e.spares[smallest]) {
			smallest = i
		}
	}
	if cap(batch) > cap(e.spares[smallest]) {
		e.spares[smallest] = batch[:0]
	}
}

// runScript runs one call on its own short-lived goroutine; rueidis pipelines the
// calls of concurrent goroutines into few round trips.
//
// The call runs under context.Background(), on purpose: rueidis writes and reads a
// lone call on the calling goroutine only when the context can never be done, and
// otherwise hands it to its pipeline goroutines, which measured here costs more than
// a loopback round trip per call (99 µs against 44 µs for a PING). What bounds a call
// to a server that stopped answering is the connection's read/write timeout
// (lockapi sets it to OpTimeout), and Close's AbortIO.
func (e *Engine) runScript(call scriptCall) {
	defer e.ioWG.Done()
	e.mail.post(e.doScript(call))
}

// doScript runs call on the calling goroutine and returns its reply.
func (e *Engine) doScript(call scriptCall) scriptDone {
	sentAt := time.Now()
	reply, err := e.runner.Run(context.Background(), call.script, call.keys, call.args)
	return scriptDone{call: call, sentAt: sentAtOf(reply, sentAt), reply: reply, err: err}
}

// doBatch is doScript for many calls at once, calls being the batch's calls as
// the runner takes them.
func (e *Engine) doBatch(br scripts.BatchRunner, batch []scriptCall, calls []scripts.Call, out []scripts.Result) batchDone {
	sentAt := time.Now()
	results := br.RunBatch(context.Background(), calls, out)
	return batchDone{calls: batch, results: results, sentAt: sentAt}
}

func (e *Engine) runSub(op subOp) {
	defer e.ioWG.Done()
	ctx, cancel := context.WithTimeout(e.ioCtx, e.opTimeout)
	defer cancel()
	switch {
	case op.unsubscribe && op.pattern:
		e.sub.PUnsubscribe(ctx, op.channel)
	case op.unsubscribe:
		e.sub.Unsubscribe(ctx, op.channel)
	}
	if op.unsubscribe {
		e.mail.post(unsubscribeDone{lock: op.lock})
		return
	}
	var err error
	if op.pattern {
		err = e.sub.PSubscribe(ctx, op.channel)
	} else {
		err = e.sub.Subscribe(ctx, op.channel)
	}
	e.mail.post(subscribeDone{lock: op.lock, err: err})
}
