package lockapi

import (
	"fmt"
	"time"

	"github.com/redis/rueidis"

	"github.com/leash-go/leash/engine"
	"github.com/leash-go/leash/internal/replyspin"
	"github.com/leash-go/leash/timer"
)

// Defaults of Options, exported so callers can derive from them.
const (
	// DefaultWatchdogTimeout is the lease of a lock acquired without WithLease; the
	// watchdog renews it every third of it. Redisson's default too.
	DefaultWatchdogTimeout = 30 * time.Second
	// MinWatchdogTimeout is the shortest WatchdogTimeout accepted: renewals run on a
	// millisecond wheel and need a few round trips of slack.
	MinWatchdogTimeout = 50 * time.Millisecond
	// DefaultFairWaitTimeout is how long a fair-lock waiter may be gone before it
	// loses its place in the queue. Redisson's default since 2020.
	DefaultFairWaitTimeout = 5 * time.Minute
	// DefaultOpTimeout bounds each Redis call leash makes.
	DefaultOpTimeout = 10 * time.Second
	// DefaultCloseTimeout bounds the releases Close makes.
	DefaultCloseTimeout = 5 * time.Second
	// DefaultDialTimeout bounds New's first connection and PING.
	DefaultDialTimeout = 5 * time.Second
	// DefaultPublicYield is Options.PublicYield's default: one tick of the engine's
	// timing wheel.
	DefaultPublicYield = timer.Tick
	// MaxPublicYield bounds Options.PublicYield: every registered waiter waits it
	// on every public release.
	MaxPublicYield = 100 * time.Millisecond
	// DefaultHandoffChain and DefaultHandoffAge are Options.HandoffChain's and
	// Options.HandoffAge's defaults: 16 handoffs, 20 ms. engine.DefaultHandoffAge
	// says why 20 ms.
	DefaultHandoffChain = engine.DefaultHandoffChain
	DefaultHandoffAge   = engine.DefaultHandoffAge
	// DefaultReplySpin is Options.ReplySpin's default; MaxReplySpin its largest
	// value: a poll longer than a millisecond would spend more CPU than a park
	// and a wake-up cost on any server worth polling for.
	DefaultReplySpin = replyspin.DefaultMax
	MaxReplySpin     = time.Millisecond
)

// Options configure a Client. The zero value of every field means its default.
type Options struct {
	// Addrs are the Redis server addresses ("host:port"). Required unless Client is
	// set. With one address leash talks to a standalone server.
	Addrs []string
	// Client, when set, is an existing rueidis client to use instead of dialling
	// Addrs; Addrs, Username, Password and DB are then ignored. Close does not close
	// it. Default: nil.
	Client rueidis.Client
	// Username and Password authenticate (Redis ACL / requirepass). Default: none.
	Username string
	Password string
	// DB selects the database. Default 0; negative is invalid.
	DB int
	// ClientID identifies this client in lock owner fields
	// ("<ClientID>:<handle number>"), as Redisson's per-client UUID does. It must be
	// unique among all clients sharing locks. Default: a random UUID.
	ClientID string
	// WatchdogTimeout is the lease of locks acquired without WithLease; the watchdog
	// renews them every WatchdogTimeout/3. Default DefaultWatchdogTimeout; at least
	// MinWatchdogTimeout.
	WatchdogTimeout time.Duration
	// FairWaitTimeout is the fair lock's wait allowance (Redisson's
	// fairLockWaitTimeout): how long a queued waiter whose process is gone keeps its
	// place after it last refreshed it (live waiters refresh every third of it). All
	// clients sharing a fair lock should use the same value. Default
	// DefaultFairWaitTimeout.
	FairWaitTimeout time.Duration
	// OpTimeout bounds each Redis call: it is the connection's read/write timeout
	// (rueidis ConnWriteTimeout), and bounds subscriptions. With Client set, that
	// client's own timeouts apply to calls instead. Default DefaultOpTimeout.
	OpTimeout time.Duration
	// CloseTimeout bounds the releases Close makes. Default DefaultCloseTimeout.
	CloseTimeout time.Duration
	// DialTimeout bounds New's first connection and PING. Default DefaultDialTimeout.
	DialTimeout time.Duration
	// PublicYield is how long a waiting Mutex that need not race for a lock released
	// to everyone waits before it tries, so that a Redisson client waiting on the
	// same lock is not outrun by leash clients every time (see the README's
	// "Redisson clients are woken, not passed over"). Default DefaultPublicYield;
	// negative turns it off; at most MaxPublicYield.
	PublicYield time.Duration
	// HandoffChain and HandoffAge bound how long this client's waiters may pass a
	// lock among themselves, by local handoffs, while waiters in other processes
	// wait: after HandoffChain handoffs in a row, or once the chain is HandoffAge
	// old, the next release goes to another process's waiter (or to everyone; see
	// the README's "Fairness within a process"). Larger bounds cross between
	// processes less often (each crossing idles the lock for a wake-up of another
	// process); smaller ones let other processes in sooner. A fair lock's handoffs
	// follow its Redis queue, so the bounds do not apply to them. Defaults
	// DefaultHandoffChain and DefaultHandoffAge; a negative HandoffChain turns
	// local handoffs off for both kinds of lock (every release goes through
	// Redis); a negative HandoffAge is invalid.
	HandoffChain int
	HandoffAge   time.Duration
	// ReplySpin is how long a Redis call alone in flight (an uncontended Lock or
	// Unlock, a waiter's attempt when nothing else is in flight) polls its
	// connection for the reply before it parks on the network poller, at most.
	// On a loopback or same-rack connection a reply then reaches the caller
	// without a kernel wake-up of an idle CPU, which costs about as much as the
	// round trip itself; the caller's goroutine keeps its CPU busy meanwhile
	// (yielding to any goroutine with work). The poll lasts at most twice the
	// running average of such replies' times, and does not happen at all while
	// that average is above ReplySpin, so a farther server costs no polling. It
	// applies to the connections leash dials itself (not to Options.Client).
	// Default DefaultReplySpin; at most MaxReplySpin; negative turns polling
	// off. A machine with one CPU never polls.
	ReplySpin time.Duration
}

// withDefaults validates o and fills in defaults.
func (o Options) withDefaults() (Options, error) {
	if o.Client == nil && len(o.Addrs) == 0 {
		return o, fmt.Errorf("%w: Options needs Addrs or Client", ErrInvalidArgument)
	}
	for _, a := range o.Addrs {
		if a == "" && o.Client == nil {
			return o, fmt.Errorf("%w: empty address in Options.Addrs", ErrInvalidArgument)
		}
	}
	if o.DB < 0 {
		return o, fmt.Errorf("%w: Options.DB is negative (%d)", ErrInvalidArgument, o.DB)
	}
	durations := []struct {
		name string
		d    *time.Duration
		def  time.Duration
	}{
		{"WatchdogTimeout", &o.WatchdogTimeout, DefaultWatchdogTimeout},
		{"FairWaitTimeout", &o.FairWaitTimeout, DefaultFairWaitTimeout},
		{"OpTimeout", &o.OpTimeout, DefaultOpTimeout},
		{"CloseTimeout", &o.CloseTimeout, DefaultCloseTimeout},
		{"DialTimeout", &o.DialTimeout, DefaultDialTimeout},
		{"HandoffAge", &o.HandoffAge, DefaultHandoffAge},
	}
	switch {
	case o.ReplySpin == 0:
		o.ReplySpin = DefaultReplySpin
	case o.ReplySpin > MaxReplySpin:
		return o, fmt.Errorf("%w: Options.ReplySpin %v is above %v", ErrInvalidArgument, o.ReplySpin, MaxReplySpin)
	}
	for _, f := range durations {
		switch {
		case *f.d < 0:
			return o, fmt.Errorf("%w: Options.%s is negative (%v)", ErrInvalidArgument, f.name, *f.d)
		case *f.d == 0:
			*f.d = f.def
		}
	}
	switch {
	case o.PublicYield == 0:
		o.PublicYield = DefaultPublicYield
	case o.PublicYield > MaxPublicYield:
		return o, fmt.Errorf("%w: Options.PublicYield %v is above %v", ErrInvalidArgument, o.PublicYield, MaxPublicYield)
	}
	if o.WatchdogTimeout < MinWatchdogTimeout {
		return o, fmt.Errorf("%w: Options.WatchdogTimeout %v is below %v", ErrInvalidArgument, o.WatchdogTimeout, MinWatchdogTimeout)
	}
	if o.ClientID == "" {
		o.ClientID = randomUUID()
	}
	return o, nil
}

// AcquireOption adjusts one Acquire or Lock call.
type AcquireOption func(*acquireConfig)

type acquireConfig struct {
	lease time.Duration
	wait  time.Duration // < 0: until ctx ends
	err   error
}

// WithLease gives the hold a fixed lease: it ends by itself after d unless
// unlocked first, and is never renewed. Without it the watchdog renews the lease for
// as long as the lock is held. d must be positive.
func WithLease(d time.Duration) AcquireOption {
	return func(c *acquireConfig) {
		if d <= 0 {
			c.err = fmt.Errorf("%w: lease must be positive, got %v", ErrInvalidArgument, d)
			return
		}
		c.lease = d
	}
}

// WithWait bounds how long to wait for the lock: after d the call ends with
// ErrNotAcquired (or the last Redis error, if Redis could not be reached). Zero
// means a single attempt. Without it, the call waits until its context ends.
func WithWait(d time.Duration) AcquireOption {
	return func(c *acquireConfig) {
		if d < 0 {
			c.err = fmt.Errorf("%w: wait must not be negative, got %v", ErrInvalidArgument, d)
			return
		}
		c.wait = d
	}
}
