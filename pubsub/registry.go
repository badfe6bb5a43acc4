package pubsub

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/redis/rueidis"
)

// ErrDisconnected is returned by Subscribe while the registry has no connection. The
// channel is still registered: it is subscribed on reconnect, after which the
// reconnect callback runs (and stays until Unsubscribe).
var ErrDisconnected = errors.New("leash: pub/sub connection is down")

// ErrClosed is returned by Subscribe after Close.
var ErrClosed = errors.New("leash: pub/sub registry closed")

// Handler receives one published message. It runs on rueidis's read goroutine and
// must not block (the engine's may step its state machine there, briefly, when
// the engine is idle: see engine.Engine.NotifyMessage).
type Handler func(channel, message string)

// Registry is a set of subscribed channels over one dedicated connection that is
// re-dialled after it drops. Its methods are safe for concurrent use.
type Registry struct {
	client      rueidis.Client
	onMessage   Handler
	onReconnect func()

	// sends orders the SUBSCRIBE and UNSUBSCRIBE commands that race for one
	// channel: Subscribe and Unsubscribe send under its read lock (the engine
	// never runs two of them for one channel at once), and a new connection's
	// clean-up (see serve) decides what to drop and sends it under its write
	// lock, so no Subscribe can register a channel after that decision and have
	// its SUBSCRIBE reach the server before the clean-up's UNSUBSCRIBE.
	sends sync.RWMutex

	mu       sync.Mutex
	channels map[topic]struct{}        // channels and patterns that should be subscribed
	pending  map[topic][]chan struct{} // Subscribe calls waiting for the server's confirmation
	conn     *connection               // nil while disconnected
	started  bool
	closed   bool

	done chan struct{}  // closed by Close; stops the connection loop
	wg   sync.WaitGroup // the connection loop
}

// connection is one dedicated pub/sub connection.
type connection struct {
	dc   rueidis.DedicatedClient
	lost chan struct{} // closed when the connection is gone
}

// Backoff bounds for re-dialling a dropped connection.
const (
	minBackoff = 20 * time.Millisecond
	maxBackoff = time.Second
)

// New returns a registry over client. Nothing is dialled until the first Subscribe.
// onMessage gets every message; onReconnect runs whenever a new connection has
// subscribed channels that were registered before it existed (after a drop, or
// after a Subscribe that returned ErrDisconnected), since messages may have been
// missed on them.
func New(client rueidis.Client, onMessage Handler, onReconnect func()) *Registry {
	return &Registry{
		client:      client,
		onMessage:   onMessage,
		onReconnect: onReconnect,
		channels:    make(map[topic]struct{}),
		pending:     make(map[topic][]chan struct{}),
		done:        make(chan struct{}),
	}
}

// topic is a channel name, or a glob pattern (PSUBSCRIBE).
type topic struct {
	name    string
	pattern bool
}

func (t topic) subscribe(dc rueidis.DedicatedClient) rueidis.Completed {
	if t.pattern {
		return dc.B().Psubscribe().Pattern(t.name).Build()
	}
	return dc.B().Subscribe().Channel(t.name).Build()
}

func (t topic) unsubscribe(dc rueidis.DedicatedClient) rueidis.Completed {
	if t.pattern {
		return dc.B().Punsubscribe().Pattern(t.name).Build()
	}
	return dc.B().Unsubscribe().Channel(t.name).Build()
}

// Subscribe registers channel and, when connected, subscribes it and waits for the
// server's confirmation. It returns nil once messages on channel will be delivered;
// ErrDisconnected when there is no connection right now; ctx's error; ErrClosed
// after Close; or the connection's error. On any error but ErrClosed the channel
// stays registered, and is subscribed on the next connection: a caller that no
// longer wants it must Unsubscribe it all the same.
func (r *Registry) Subscribe(ctx context.Context, channel string) error {
	return r.subscribe(ctx, topic{name: channel})
}

// PSubscribe is Subscribe for a glob pattern (PSUBSCRIBE): messages on every
// channel matching pattern are delivered, under their own channel names.
func (r *Registry) PSubscribe(ctx context.Context, pattern string) error {
	return r.subscribe(ctx, topic{name: pattern, pattern: true})
}

// Unsubscribe forgets channel and, when connected, unsubscribes it. Errors are not
// reported: a stale subscription only costs a message the engine ignores.
func (r *Registry) Unsubscribe(ctx context.Context, channel string) {
	r.unsubscribe(ctx, topic{name: channel})
}

// PUnsubscribe is Unsubscribe for a pattern.
func (r *Registry) PUnsubscribe(ctx context.Context, pattern string) {
	r.unsubscribe(ctx, topic{name: pattern, pattern: true})
}

func (r *Registry) subscribe(ctx context.Context, channel topic) error {
	r.sends.RLock()
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		r.sends.RUnlock()
		return ErrClosed
	}
	r.channels[channel] = struct{}{}
	r.startLocked()
	conn := r.conn
	if conn == nil {
		r.mu.Unlock()
		r.sends.RUnlock()
		return ErrDisconnected
	}
	confirmed := make(chan struct{})
	r.pending[channel] = append(r.pending[channel], confirmed)
	r.mu.Unlock()

	err := conn.dc.Do(ctx, channel.subscribe(conn.dc)).Error()
	r.sends.RUnlock()
	if err != nil {
		r.dropPending(channel, confirmed)
		return err
	}
	select {
	case <-confirmed:
		return nil
	case <-conn.lost:
		r.dropPending(channel, confirmed)
		return ErrDisconnected
	case <-ctx.Done():
		r.dropPending(channel, confirmed)
		return ctx.Err()
	case <-r.done:
		return ErrClosed
	}
}

func (r *Registry) dropPending(channel topic, c chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	list := r.pending[channel]
	for i, p := range list {
		if p == c {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(r.pending, channel)
	} else {
		r.pending[channel] = list
	}
}

func (r *Registry) unsubscribe(ctx context.Context, channel topic) {
	r.sends.RLock()
	defer r.sends.RUnlock()
	r.mu.Lock()
	delete(r.channels, channel)
	conn := r.conn
	r.mu.Unlock()
	if conn != nil {
		_ = conn.dc.Do(ctx, channel.unsubscribe(conn.dc)).Error()
	}
}

// Channels returns how many channels are registered (for tests and metrics).
func (r *Registry) Channels() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.channels)
}

// Close stops the connection loop and waits for it. It is idempotent.
func (r *Registry) Close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	close(r.done)
	r.mu.Unlock()
	r.wg.Wait()
}

// run keeps one connection alive until Close, re-dialling with backoff.
func (r *Registry) run() {
	defer r.wg.Done()
	backoff := minBackoff
	for {
		if ok := r.serve(&backoff); !ok {
			return
		}
		select {
		case <-time.After(backoff):
		case <-r.done:
			return
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// serve dials one connection, subscribes every registered channel, and blocks until
// the connection drops (true) or the registry closes (false).
func (r *Registry) serve(backoff *time.Duration) bool {
	dc, release := r.client.Dedicate()
	defer release()
	conn := &connection{dc: dc, lost: make(chan struct{})}
	wait := dc.SetPubSubHooks(rueidis.PubSubHooks{
		OnMessage:      func(m rueidis.PubSubMessage) { r.onMessage(m.Channel, m.Message) },
		OnSubscription: r.onSubscription,
	})
	// Register the connection before taking the snapshot, under one lock: a channel
	// added after this point is subscribed by its own Subscribe call.
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		dc.Close()
		<-wait
		return false
	}
	r.conn = conn
	var channels, patterns []string
	var confirmations []chan struct{} // one per snapshot topic (see onSubscription)
	for t := range r.channels {
		if t.pattern {
			patterns = append(patterns, t.name)
		} else {
			channels = append(channels, t.name)
		}
		c := make(chan struct{})
		r.pending[t] = append(r.pending[t], c)
		confirmations = append(confirmations, c)
	}
	r.mu.Unlock()
	snapshot := len(channels) + len(patterns)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	cmds := make(rueidis.Commands, 0, 2)
	if len(channels) > 0 {
		cmds = append(cmds, dc.B().Subscribe().Channel(channels...).Build())
	}
	if len(patterns) > 0 {
		cmds = append(cmds, dc.B().Psubscribe().Pattern(patterns...).Build())
	}
	if len(cmds) == 0 {
		cmds = append(cmds, dc.B().Ping().Build())
	}
	testHooks.snapshotSending()
	ok := true
	for _, res := range dc.DoMulti(ctx, cmds...) {
		if res.Error() != nil {
			ok = false
		}
	}
	// The reconnect callback says the channels are live again: wait for the
	// server's confirmation of each (DoMulti may return before it is handled).
	if ok {
		ok = awaitAll(ctx, confirmations, wait, r.done)
	}
	r.mu.Lock()
	for t, list := range r.pending { // the confirmations still waited for, if any
		list = slices.DeleteFunc(list, func(c chan struct{}) bool { return slices.Contains(confirmations, c) })
		if len(list) == 0 {
			delete(r.pending, t)
		} else {
			r.pending[t] = list
		}
	}
	r.mu.Unlock()
	// A channel unsubscribed while the snapshot was on its way may have had its
	// UNSUBSCRIBE reach the server first: drop it again now. The decision and the
	// sends hold r.sends, so a Subscribe that registers a channel after the
	// decision sends its SUBSCRIBE after the clean-up's UNSUBSCRIBE. One round
	// trip for them all keeps Subscribe's wait short.
	if ok {
		r.sends.Lock()
		drop := r.dropped(channels, patterns)
		testHooks.dropping()
		if cmds := unsubscribeAll(dc, drop); len(cmds) > 0 {
			dc.DoMulti(ctx, cmds...) // errors: the connection is going, and the channels with it
		}
		r.sends.Unlock()
		testHooks.dropped()
	}
	cancel()
	if ok {
		*backoff = minBackoff
		// Channels subscribed here, rather than by their own Subscribe call, may have
		// missed messages (their Subscribe returned ErrDisconnected, or the previous
		// connection dropped): tell the engine.
		if snapshot > 0 {
			r.onReconnect()
		}
		select {
		case <-wait:
		case <-r.done:
		}
	}
	r.mu.Lock()
	r.conn = nil
	closed := r.closed
	r.mu.Unlock()
	close(conn.lost)
	dc.Close()
	<-wait
	return !closed
}

// awaitAll waits until every channel in cs is closed; false if ctx ends, the
// connection ends (its hooks' channel, which is closed then), or done is closed
// first.
func awaitAll(ctx context.Context, cs []chan struct{}, lost <-chan error, done <-chan struct{}) bool {
	for _, c := range cs {
		select {
		case <-c:
		case <-ctx.Done():
			return false
		case <-lost:
			return false
		case <-done:
			return false
		}
	}
	return true
}

// unsubscribeAll returns one UNSUBSCRIBE for the channels among topics and one
// PUNSUBSCRIBE for the patterns (none for an empty group).
func unsubscribeAll(dc rueidis.DedicatedClient, topics []topic) rueidis.Commands {
	var channels, patterns []string
	for _, t := range topics {
		if t.pattern {
			patterns = append(patterns, t.name)
		} else {
			channels = append(channels, t.name)
		}
	}
	var cmds rueidis.Commands
	if len(channels) > 0 {
		cmds = append(cmds, dc.B().Unsubscribe().Channel(channels...).Build())
	}
	if len(patterns) > 0 {
		cmds = append(cmds, dc.B().Punsubscribe().Pattern(patterns...).Build())
	}
	return cmds
}

// dropped returns the topics of a snapshot that are no longer registered.
func (r *Registry) dropped(channels, patterns []string) []topic {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []topic
	for _, name := range channels {
		if _, ok := r.channels[topic{name: name}]; !ok {
			out = append(out, topic{name: name})
		}
	}
	for _, name := range patterns {
		if _, ok := r.channels[topic{name: name, pattern: true}]; !ok {
			out = append(out, topic{name: name, pattern: true})
		}
	}
	return out
}

func (r *Registry) onSubscription(s rueidis.PubSubSubscription) {
	if s.Kind != "subscribe" && s.Kind != "psubscribe" {
		return
	}
	t := topic{name: s.Channel, pattern: s.Kind == "psubscribe"}
	r.mu.Lock()
	waiting := r.pending[t]
	delete(r.pending, t)
	r.mu.Unlock()
	for _, c := range waiting {
		close(c)
	}
}

// Start dials the connection now instead of at the first Subscribe, so the first
// waiter does not pay for it. It is idempotent.
func (r *Registry) Start() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.closed {
		r.startLocked()
	}
}

// startLocked starts the connection loop once. r.mu must be held.
func (r *Registry) startLocked() {
	if r.started {
		return
	}
	r.started = true
	r.wg.Add(1)
	go r.run()
}

// testHooks lets a test of this package act at three points of serve: as the
// snapshot is about to be sent, between its clean-up's decision of what to drop
// and the sends (under r.sends), and after them. Its fields are nil outside tests.
var testHooks registryHooks

type registryHooks struct {
	onSnapshotSending, onDropping, onDropped func()
}

func (h *registryHooks) snapshotSending() {
	if h.onSnapshotSending != nil {
		h.onSnapshotSending()
	}
}

func (h *registryHooks) dropping() {
	if h.onDropping != nil {
		h.onDropping()
	}
}

func (h *registryHooks) dropped() {
	if h.onDropped != nil {
		h.onDropped()
	}
}
