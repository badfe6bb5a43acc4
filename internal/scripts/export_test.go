package scripts

// RedisCRC64 is redisCRC64, for the tests.
var RedisCRC64 = redisCRC64

// BusyKey and TransientRefusal are busyKey and transientRefusal, for the tests.
var (
	BusyKey          = busyKey
	TransientRefusal = transientRefusal
)
